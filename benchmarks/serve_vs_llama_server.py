"""vt serve against llama-server: completion tokens/s with 1, 4 and 16 chat clients.

    python benchmarks/serve_vs_llama_server.py [--model PATH] [--llama-server PATH]
        [--clients 1,4,16] [--max-tokens 64] [--requests-per-client 4] [--rounds 1]
        [--threads 2] [--slots 16] [--time-limit-s 300] [--vt-baseline CMD] [--out FILE]
        [--backend cpu] [--llama-args ARGS]

Starts ``vt serve --backend BACKEND --max-slots SLOTS`` and ``llama-server -t THREADS -np
SLOTS LLAMA_ARGS`` on free loopback ports (on a GPU: ``--backend cuda --llama-args='-ngl
99'``, llama-server built with CUDA: ``gpu_vs_llama_cpp.py --build-only --server``), both
for the whole run (an idle server waits without using the CPU), waits for each one's ``GET
/health``, then for each client count and round measures the two servers one after the
other, the order flipped every time.

A measurement: N threads, each with its own official ``openai`` client, send chat
completions (``temperature 0``, ``max_tokens``, ``ignore_eos`` so that both servers
generate exactly ``max_tokens`` tokens per request) one after another until
``requests-per-client * N`` requests were sent or ``--time-limit-s`` passed (no new
request after that; the answers in flight are waited for, each up to
``--request-timeout-s``). Every request has its own user message (the same sequence for
both servers in a round, new in every round and never the warm-up's), so no prompt is
served whole from a cache; the chat template's common start is, by a server with a prompt
cache (llama-server's slots, vt's prefix caching), and ``cached_prompt_tokens`` says how
many tokens each server reported taking from it.
Before each measurement N short requests warm the server up, then it waits (at
most ``--quiet-wait-s``) until the rest of the machine keeps less than ``--quiet-below``
of the CPUs busy; ``others_cpu_share`` says how busy other processes (not the two
servers, not the clients) kept the CPUs during the measurement, and a measurement with
more than ``--quiet-below`` is taken again, up to ``--retry-noisy`` times (all are kept). Reported:
completion tokens (the servers' ``usage``) per second of wall time from the first
request to the last answer, mean request latency, and vt/llama-server ratios.

``--vt-baseline CMD`` starts a third server from another vt command (for example a venv
of an older commit) and measures it in the same rounds, in the same alternation, so a
change's before/after and both against llama-server come from one run
(``vt_vs_baseline`` in the JSON); ``--vt-baseline-args`` adds ``vt serve`` options to
it, so ``--vt-baseline vt --vt-baseline-args=--no-prefix-caching`` measures a setting.

Both servers are stopped at the end, on an error and on SIGTERM/Ctrl-C (SIGTERM, then
SIGKILL after 10 s). The default model is ``vt model pull -q``'s path; llama-server is
``--llama-server``, ``$LLAMA_SERVER``, then ``PATH``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpu_vs_llama_cpp import gpu_names
from machine import busy_cpu_s, wait_quiet
from openai import OpenAI

MODEL_NAME = "bench"
WARM_UP_K = 900_000  # the warm-up's request numbers: no measured prompt was seen before
TOPICS = (
    "a lighthouse keeper",
    "the history of bread",
    "how rivers form",
    "a robot learning to paint",
    "why the sky is blue",
    "a city under the sea",
    "the life of a honeybee",
    "a journey across a desert",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process in its own session, its output in a temporary file."""

    def __init__(self, name: str, cmd: list[str], port: int) -> None:
        self.name, self.cmd, self.port = name, cmd, port
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> None:
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.ready_s = time.perf_counter() - t0
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f} s: {self.tail()}")

    def tail(self, lines: int = 5) -> str:
        text = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process (all its threads) has used so far (Linux ``/proc``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s(servers: list[Server]) -> float:
    """CPU seconds of this benchmark's processes: the clients here and both servers."""
    t = os.times()
    own = t.user + t.system
    return own + sum(process_cpu_s(s.proc.pid) for s in servers if s.proc is not None)


def chat(client: OpenAI, k: int, max_tokens: int) -> dict[str, Any]:
    topic = TOPICS[k % len(TOPICS)]
    t0 = time.perf_counter()
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": f"Request {k}: write a short story about {topic}."}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    usage = reply.usage
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "latency_s": time.perf_counter() - t0,
        "completion_tokens": usage.completion_tokens if usage else 0,
        "prompt_tokens": usage.prompt_tokens if usage else 0,
        "cached_tokens": (getattr(details, "cached_tokens", None) or 0) if details else 0,
    }


def load(
    server: Server,
    clients: int,
    n_requests: int,
    max_tokens: int,
    limit: float,
    timeout: float,
    first_k: int = 0,
) -> dict:
    """``clients`` threads share ``n_requests`` requests (numbered from ``first_k``, so both
    servers get the same prompts); none starts after ``limit`` seconds, each may take
    ``timeout``."""
    lock = threading.Lock()
    next_k = [first_k]
    n_requests += first_k
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    t0 = time.perf_counter()

    def worker() -> None:
        client = OpenAI(
            base_url=server.base_url + "/v1", api_key="unused", timeout=timeout, max_retries=0
        )
        while True:
            with lock:
                if next_k[0] >= n_requests or time.perf_counter() - t0 > limit:
                    return
                k = next_k[0]
                next_k[0] += 1
            try:
                res = chat(client, k, max_tokens)
            except Exception as e:  # any failure is reported, not raised
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                continue
            res["end_s"] = time.perf_counter() - t0
            with lock:
                results.append(res)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=limit + timeout + 30)
    wall = max((r["end_s"] for r in results), default=time.perf_counter() - t0)
    tokens = sum(r["completion_tokens"] for r in results)
    return {
        "requests": len(results),
        "errors": errors,
        "completion_tokens": tokens,
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        # what the server says it took from its prompt cache (usage.prompt_tokens_details)
        "cached_prompt_tokens": sum(r["cached_tokens"] for r in results),
        "short_answers": sum(r["completion_tokens"] < max_tokens for r in results),
        "wall_s": round(wall, 2),
        "completion_tok_s": round(tokens / wall, 2) if wall > 0 else None,
        "mean_latency_s": (
            round(sum(r["latency_s"] for r in results) / len(results), 2) if results else None
        ),
    }


def measure(
    servers: dict[str, Server], name: str, n: int, args: argparse.Namespace, first_k: int = 0
) -> dict:
    """Warm ``name`` up, wait for a quiet machine, then one measurement with ``n`` clients
    whose requests are numbered from ``first_k``."""
    limits = (args.time_limit_s, args.request_timeout_s)
    load(servers[name], n, n, 4, *limits, first_k=WARM_UP_K)  # prompts never measured
    gate = wait_quiet(args.quiet_below, args.quiet_wait_s)
    every = list(servers.values())
    busy0, own0 = busy_cpu_s(), own_cpu_s(every)
    res = load(servers[name], n, n * args.requests_per_client, args.max_tokens, *limits, first_k)
    busy1, own1 = busy_cpu_s(), own_cpu_s(every)
    if busy0 is not None and busy1 is not None and res["wall_s"]:
        others = max(0.0, busy1 - busy0 - (own1 - own0))
        res["others_cpu_share"] = round(others / (res["wall_s"] * (os.cpu_count() or 1)), 3)
    res["quiet_gate"] = gate
    res["loadavg"] = round(os.getloadavg()[0], 2)
    return res


def find_binary(given: str | None, env: str, name: str) -> str:
    path = given or os.environ.get(env) or shutil.which(name)
    if not path or not Path(path).exists():
        raise SystemExit(f"{name} not found: pass --{name} PATH or set {env}")
    return str(Path(path).resolve())


def server_commands(
    args: argparse.Namespace, vt: list[str], llama: str, model: str
) -> dict[str, tuple[str, list[str], int]]:
    """Each server's (name, command line, port): vt serve on ``--backend``, llama-server
    with ``--llama-args``, and the baseline vt where ``--vt-baseline`` names one."""
    vt_port, llama_port = free_port(), free_port()
    common = ["--max-model-len", str(args.ctx_per_slot), "--served-model-name", MODEL_NAME]
    common += ["--log-level", "warning"]
    servers = {
        "vt": (
            "vt",
            [*vt, "serve", "--backend", args.backend, "--model", model, "--port", str(vt_port)]
            + ["--max-slots", str(args.slots), *common],
            vt_port,
        ),
        "llama_server": (
            "llama-server",
            [llama, "-m", model, "-t", str(args.threads), "-np", str(args.slots)]
            + ["-c", str(args.slots * args.ctx_per_slot), "--host", "127.0.0.1"]
            + ["--port", str(llama_port), "-a", MODEL_NAME, "--no-webui"]
            + shlex.split(args.llama_args),
            llama_port,
        ),
    }
    if args.vt_baseline:
        port = free_port()
        servers["vt_baseline"] = (
            "vt-baseline",
            [*shlex.split(args.vt_baseline), "serve", "--backend", args.backend]
            + ["--model", model, "--port", str(port), "--max-slots", str(args.slots), *common]
            + shlex.split(args.vt_baseline_args),
            port,
        )
    return servers


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="a GGUF file (default: vt's default model)")
    ap.add_argument("--llama-server", help="llama-server binary ($LLAMA_SERVER, PATH)")
    ap.add_argument("--vt", default="vt", help="the vt command (default: vt)")
    ap.add_argument(
        "--vt-baseline",
        help="another vt command (e.g. an older tree's venv), measured in the same rounds",
    )
    ap.add_argument(
        "--vt-baseline-args",
        default="",
        help="extra 'vt serve' options of the baseline (e.g. --no-prefix-caching)",
    )
    ap.add_argument("--clients", default="1,4,16", help="concurrent clients, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds; best kept")
    ap.add_argument("--threads", type=int, default=2, help="llama-server's -t (2)")
    ap.add_argument("--slots", type=int, default=16, help="llama-server -np, vt --max-slots")
    ap.add_argument("--ctx-per-slot", type=int, default=1024, help="vt --max-model-len")
    ap.add_argument("--time-limit-s", type=float, default=300, help="per measurement")
    ap.add_argument("--quiet-below", type=float, default=0.15, help="see vs_llama_cpp.py")
    ap.add_argument("--retry-noisy", type=int, default=1, help="see vs_llama_cpp.py (1)")
    ap.add_argument("--quiet-wait-s", type=float, default=120, help="longest wait; 0: off")
    ap.add_argument("--request-timeout-s", type=float, default=600)
    ap.add_argument("--start-timeout-s", type=float, default=600)
    ap.add_argument("--backend", default="cpu", help="vt serve's --backend (cpu)")
    ap.add_argument(
        "--llama-args", default="", help="extra llama-server options (on a GPU: '-ngl 99')"
    )
    ap.add_argument("--label", default="", help="free text kept in the JSON (vt's commit)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    argv = sys.argv[1:]
    vt = shlex.split(args.vt)
    llama = find_binary(args.llama_server, "LLAMA_SERVER", "llama-server")
    if args.model:
        model = str(Path(args.model).expanduser().resolve())
    else:
        pulled = subprocess.run([*vt, "model", "pull", "-q"], capture_output=True, text=True)
        model = pulled.stdout.strip().splitlines()[-1]
    levels = [int(c) for c in args.clients.split(",")]

    servers = {
        name: Server(label, cmd, port)
        for name, (label, cmd, port) in server_commands(args, vt, llama, model).items()
    }

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds to the finally below

    signal.signal(signal.SIGTERM, stop)
    started = datetime.now(timezone.utc)
    results: dict[str, Any] = {}
    try:
        for server in servers.values():
            server.start(args.start_timeout_s)
            print(f"{server.name} ready in {server.ready_s:.1f} s", file=sys.stderr, flush=True)
        turn = 0
        for level, n in enumerate(levels):
            samples: dict[str, list[dict]] = {name: [] for name in servers}
            for rnd in range(args.rounds):
                order = list(servers) if turn % 2 == 0 else list(servers)[::-1]
                turn += 1
                for name in order:
                    for attempt in range(1 + args.retry_noisy):
                        # every server gets the same prompts in a round, never seen before
                        first_k = (level * 100 + rnd * 10 + attempt) * 1000
                        res = measure(servers, name, n, args, first_k)
                        res["round"], res["attempt"] = rnd, attempt
                        samples[name].append(res)
                        print(
                            f"{n} clients, round {rnd + 1}: {name} {res['completion_tok_s']}"
                            f" tok/s ({res['requests']} requests, {len(res['errors'])} errors,"
                            f" others {res.get('others_cpu_share')})",
                            file=sys.stderr,
                            flush=True,
                        )
                        if res.get("others_cpu_share", 0) <= args.quiet_below:
                            break
            best = {
                name: max(runs, key=lambda r: r["completion_tok_s"] or 0)
                for name, runs in samples.items()
            }
            a, b = best["vt"]["completion_tok_s"], best["llama_server"]["completion_tok_s"]
            results[str(n)] = {
                "vt_completion_tok_s": a,
                "llama_server_completion_tok_s": b,
                "ratio": round(a / b, 3) if a and b else None,
                "samples": samples,
            }
            if "vt_baseline" in best:
                c = best["vt_baseline"]["completion_tok_s"]
                results[str(n)]["vt_baseline_completion_tok_s"] = c
                results[str(n)]["vt_vs_baseline"] = round(a / c, 3) if a and c else None
    finally:
        for server in servers.values():
            server.stop()

    out = {
        "command": shlex.join(["python", "benchmarks/serve_vs_llama_server.py", *argv]),
        "label": args.label,
        "backend": args.backend,
        "device": None if args.backend == "cpu" else gpu_names(),
        "started_utc": started.isoformat(timespec="seconds"),
        "seconds": round((datetime.now(timezone.utc) - started).total_seconds()),
        "model": {"path": model, "file_bytes": Path(model).stat().st_size},
        "servers": {
            name: {"cmd": shlex.join(s.cmd), "ready_s": round(s.ready_s or 0, 2)}
            for name, s in servers.items()
        },
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests_per_client,
        "ratios": {n: r["ratio"] for n, r in results.items()},
        "vt_vs_baseline": {n: r.get("vt_vs_baseline") for n, r in results.items()},
        "levels": results,
    }
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
