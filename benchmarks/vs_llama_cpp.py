"""vt against llama.cpp on CPU, in one run: decode, prefill, start-up, memory, under load.

    python benchmarks/vs_llama_cpp.py [--model PATH] [--llama-bench PATH] [--rounds 3]
        [--prompt-tokens 128] [--gen-tokens 64] [--threads 2] [--under-load]
        [--vt-variant KEY=VAL[,KEY=VAL]] [--out FILE]

Each round runs ``vt bench --backend cpu --json`` and ``llama-bench -t THREADS -p PROMPT
-n GEN -o json`` as separate processes, one after the other, the order flipped every
round so that a noisy neighbour slows both sides alike; the best rate of all rounds is
kept (noise only ever slows a run down). ``vt bench`` measures async scheduling on (what
users get) and off; ``vt`` below is async on, ``vt_sync`` off. Each round also times one
cold start of each engine, process start to first token, with a warm page cache:
``vt run --raw -n 1`` against ``llama-bench -p 1 -n 0 -r 1 --no-warmup``.

``--under-load`` measures everything again with two CPU-bound processes beside both
engines (each stops itself after ``--load-max-s``, and they are killed when the
measurement ends); ``--vt-variant`` adds vt runs with extra environment variables (e.g.
``OPENBLAS_NUM_THREADS=1``), measured in the same rounds. Before the first round, one
untimed ``vt run`` per vt setting fills the disk caches (compiled kernels, verification).
On a shared machine each quiet run waits (at most ``--quiet-wait-s``) until the rest of
the machine keeps less than ``--quiet-below`` of the CPUs busy (``quiet_gate`` per sample),
and a run during which it did not (``others_cpu_share``) is run again, up to
``--retry-noisy`` times; every run is kept in ``samples`` and the best of all is reported.

``ratios`` holds vt/llama.cpp for every condition and vt setting: ``decode`` and
``prefill`` are rate ratios (above 1: vt faster), ``start_to_first_token`` a ratio of
times (above 1: vt slower); ``load_vs_quiet`` each engine's loaded/quiet decode rate;
``memory.*.peak_rss_vs_file`` peak RSS over the file's size; ``*.others_cpu_share`` the
share of the CPUs that other processes (the hogs too) kept busy during the runs.

Peak RSS is each process's own ``ru_maxrss`` (``os.wait4``), against the model file's size.
Only the ``vt`` CLI is used, so the script measures whatever vt is installed. llama-bench
is found by ``--llama-bench``, then ``$LLAMA_BENCH``, then ``PATH``; the default model is
``vt model pull -q``'s path. Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from machine import busy_cpu_s, wait_quiet

MIB = 1 << 20
HOG = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"


# --------------------------------------------------------------------------- processes


def run_measured(cmd: list[str], env: dict[str, str] | None, timeout: float) -> dict[str, Any]:
    """Run ``cmd`` to completion (killed after ``timeout``): stdout, stderr, wall, peak RSS.

    ``others_cpu_share``: the share of the machine's CPUs that other processes kept busy
    while it ran (machine busy time less the command's own CPU time), a noise gauge.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        busy0 = busy_cpu_s()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        busy1 = busy_cpu_s()
        others = None
        if busy0 is not None and busy1 is not None:
            own = usage.ru_utime + usage.ru_stime
            others = max(0.0, busy1 - busy0 - own) / (wall * (os.cpu_count() or 1))
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        out.seek(0)
        err.seek(0)
        return {
            "cmd": cmd,
            "rc": proc.returncode,
            "timed_out": timed_out,
            "wall_s": wall,
            "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
            "others_cpu_share": None if others is None else round(others, 3),
            "stdout": out.read().decode(errors="replace"),
            "stderr": err.read().decode(errors="replace"),
        }


def failure(res: dict[str, Any]) -> str | None:
    if res["timed_out"]:
        return f"timed out after {res['wall_s']:.0f} s: {shlex.join(res['cmd'])}"
    if res["rc"] != 0:
        tail = res["stderr"].strip().splitlines()[-3:]
        return f"exit {res['rc']}: {shlex.join(res['cmd'])}: {' | '.join(tail)}"
    return None


class Hogs:
    """``n`` CPU-bound processes that stop themselves after ``limit`` seconds at the latest."""

    def __init__(self, n: int, limit: float) -> None:
        self.n, self.limit = n, limit
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Hogs:
        code = HOG.format(limit=self.limit)
        for _ in range(self.n):
            self.procs.append(
                subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
            )
        time.sleep(1.0)  # let the scheduler see them before the first measurement
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=10)


# --------------------------------------------------------------------------- engines


def vt_bench(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    cmd = [
        *args.vt,
        "bench",
        "--backend",
        "cpu",
        "--json",
        "--model",
        args.model,
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--gen-tokens",
        str(args.gen_tokens),
        "--repeat",
        str(args.repeat),
    ]
    res = run_measured(cmd, env, args.timeout)
    if err := failure(res):
        return {"error": err}
    data = json.loads(res["stdout"])
    out: dict[str, Any] = {
        "load_s": data["load_s"],
        "peak_rss_bytes": res["peak_rss_bytes"],
        "wall_s": round(res["wall_s"], 1),
        "others_cpu_share": res["others_cpu_share"],
    }
    for run in data["runs"]:
        key = "async" if run["async_scheduling"] else "sync"
        out[key] = {
            "prefill_tok_s": run["prefill_tok_s"],
            "decode_tok_s": run["decode_tok_s"],
            "readback": run.get("readback"),
        }
        kv = run.get("kv_cache") or {}
        out["kv_mapped_bytes"] = max(out.get("kv_mapped_bytes", 0), kv.get("mapped_bytes", 0))
    out["same_ids"] = data.get("same_ids")
    return out


def vt_start(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    cmd = [*args.vt, "run", "--backend", "cpu", "--model", args.model, "--raw", "-n", "1"]
    cmd += ["--ignore-eos", "--json", "Hello"]
    res = run_measured(cmd, env, args.timeout)
    if err := failure(res):
        return {"error": err}
    return {"start_to_first_token_s": res["wall_s"], "peak_rss_bytes": res["peak_rss_bytes"]}


def llama_bench(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [args.llama_bench, "-m", args.model, "-t", str(args.threads)]
    cmd += ["-p", str(args.prompt_tokens), "-n", str(args.gen_tokens), "-r", str(args.repeat)]
    res = run_measured([*cmd, "-o", "json"], None, args.timeout)
    if err := failure(res):
        return {"error": err}
    out: dict[str, Any] = {
        "peak_rss_bytes": res["peak_rss_bytes"],
        "wall_s": round(res["wall_s"], 1),
        "others_cpu_share": res["others_cpu_share"],
    }
    for test in json.loads(res["stdout"]):
        key = "prefill_tok_s" if test["n_gen"] == 0 else "decode_tok_s"
        out[key] = max(test["samples_ts"])
        out["build_commit"] = test.get("build_commit")
        out["cpu_info"] = test.get("cpu_info")
        out["model_type"] = test.get("model_type")
    return out


def llama_start(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [args.llama_bench, "-m", args.model, "-t", str(args.threads)]
    cmd += ["-p", "1", "-n", "0", "-r", "1", "--no-warmup", "-o", "json"]
    res = run_measured(cmd, None, args.timeout)
    if err := failure(res):
        return {"error": err}
    return {"start_to_first_token_s": res["wall_s"], "peak_rss_bytes": res["peak_rss_bytes"]}


# --------------------------------------------------------------------------- measurement


def warm_up(args: argparse.Namespace) -> dict[str, Any]:
    """One untimed ``vt run`` per vt setting before any measurement: it fills the disk
    caches a backend may keep (compiled kernels, the verification record) and fails early."""
    done = {}
    for name, env in {"vt": {}, **{f"vt[{v}]": e for v, e in args.variants.items()}}.items():
        cmd = [*args.vt, "run", "--backend", "cpu", "--model", args.model, "--raw", "-n", "2"]
        res = run_measured([*cmd, "--ignore-eos", "Hello"], os.environ | env, args.timeout)
        if err := failure(res):
            raise SystemExit(f"warm-up failed: {err}")
        done[name] = round(res["wall_s"], 1)
    return done


def one_run(
    args: argparse.Namespace, condition: str, name: str, env: Any, rnd: int, attempt: int
) -> dict[str, Any]:
    """One measured run of one engine (``env`` None: llama.cpp), after the quiet gate."""
    gate = None
    if condition == "quiet" and args.quiet_wait_s > 0:
        gate = wait_quiet(args.quiet_below, args.quiet_wait_s)
    t0 = time.perf_counter()
    if env is None:
        res = llama_bench(args)
        if args.startup:
            res["startup"] = llama_start(args)
    else:
        res = vt_bench(args, os.environ | env)
        if args.startup:
            res["startup"] = vt_start(args, os.environ | env)
    res["round"], res["attempt"] = rnd, attempt
    if gate is not None:
        res["quiet_gate"] = gate
    note = f" ERROR {res['error']}" if "error" in res else ""
    print(
        f"[{condition}] round {rnd + 1}/{args.rounds} {name}"
        f"{f' (again, attempt {attempt + 1})' if attempt else ''}: "
        f"{time.perf_counter() - t0:.0f} s, others {res.get('others_cpu_share')}{note}",
        file=sys.stderr,
        flush=True,
    )
    return res


def measure(args: argparse.Namespace, condition: str) -> dict[str, Any]:
    """Alternate the engines for ``args.rounds`` rounds; every sample and the best of each."""
    variants = {"vt": {}} | {f"vt[{v}]": env for v, env in args.variants.items()}
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in [*variants, "llama_cpp"]}
    loadavg = [os.getloadavg()]
    for rnd in range(args.rounds):
        jobs: list[tuple[str, Any]] = [(name, env) for name, env in variants.items()]
        jobs.append(("llama_cpp", None))
        if rnd % 2:
            jobs.reverse()
        for name, env in jobs:
            for attempt in range(1 + (args.retry_noisy if condition == "quiet" else 0)):
                res = one_run(args, condition, name, env, rnd, attempt)
                samples[name].append(res)
                share = res.get("others_cpu_share")
                if share is None or share <= args.quiet_below:
                    break
        loadavg.append(os.getloadavg())

    best: dict[str, dict[str, Any]] = {}
    for name, runs in samples.items():
        good = [r for r in runs if "error" not in r]
        b: dict[str, Any] = {
            "ok_rounds": len(good),
            "errors": [r["error"] for r in runs if "error" in r],
        }
        settings = ["async", "sync"] if name != "llama_cpp" else [None]
        for setting in settings:
            target = b if setting in (None, "async") else b.setdefault("sync", {})
            for metric in ("prefill_tok_s", "decode_tok_s"):
                vals = [(r[setting] if setting else r).get(metric) for r in good]
                vals = [v for v in vals if v]
                target[metric] = round(max(vals), 2) if vals else None
        b["peak_rss_bytes"] = max((r["peak_rss_bytes"] for r in good), default=None)
        shares = [r["others_cpu_share"] for r in good if r.get("others_cpu_share") is not None]
        b["others_cpu_share_mean"] = round(sum(shares) / len(shares), 3) if shares else None
        if name != "llama_cpp":
            b["load_s"] = round(min((r["load_s"] for r in good), default=float("nan")), 3)
            b["kv_mapped_bytes"] = max((r.get("kv_mapped_bytes", 0) for r in good), default=0)
            b["same_ids"] = all(r.get("same_ids") for r in good) if good else None
        else:
            b["build_commit"] = next((r["build_commit"] for r in good), None)
            b["model_type"] = next((r["model_type"] for r in good), None)
        starts = [r["startup"] for r in good if "startup" in r and "error" not in r["startup"]]
        if starts:
            b["start_to_first_token_s"] = round(min(s["start_to_first_token_s"] for s in starts), 3)
            b["startup_peak_rss_bytes"] = max(s["peak_rss_bytes"] for s in starts)
        best[name] = b

    ref = best["llama_cpp"]
    ratios: dict[str, Any] = {}
    for name in variants:
        r: dict[str, Any] = {}
        for src, suffix in ((best[name], ""), (best[name].get("sync", {}), "_sync")):
            for metric, key in (("decode_tok_s", "decode"), ("prefill_tok_s", "prefill")):
                r[key + suffix] = _ratio(src.get(metric), ref.get(metric))
        r["start_to_first_token"] = _ratio(
            best[name].get("start_to_first_token_s"), ref.get("start_to_first_token_s")
        )
        ratios[name] = r
    return {
        "loadavg_before_each_round_and_after": [[round(x, 2) for x in la] for la in loadavg],
        "best": best,
        "ratio_vs_llama_cpp": ratios,
        "samples": samples,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def memory(best: dict[str, Any], file_bytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {"model_file_bytes": file_bytes}
    for name, b in best.items():
        rss = b.get("peak_rss_bytes")
        if not rss:
            continue
        entry: dict[str, Any] = {
            "peak_rss_mib": round(rss / MIB, 1),
            "peak_rss_vs_file": round(rss / file_bytes, 3),
        }
        if "kv_mapped_bytes" in b:
            # The goal: peak RSS <= file + KV cache + 200 MB.
            entry["kv_mapped_mib"] = round(b["kv_mapped_bytes"] / MIB, 1)
            entry["rss_over_file_plus_kv_mib"] = round(
                (rss - file_bytes - b["kv_mapped_bytes"]) / MIB, 1
            )
        out[name] = entry
    return out


# --------------------------------------------------------------------------- main


def default_model(vt: list[str]) -> str:
    res = subprocess.run([*vt, "model", "pull", "-q"], capture_output=True, text=True, check=True)
    return res.stdout.strip().splitlines()[-1]


def find_llama_bench(given: str | None) -> str:
    path = given or os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    if not path or not Path(path).exists():
        raise SystemExit(
            "llama-bench not found: pass --llama-bench PATH or set LLAMA_BENCH "
            "(build llama.cpp with: cmake -B build -DGGML_NATIVE=ON && cmake --build build)"
        )
    return str(Path(path).resolve())


def parse_variant(text: str) -> dict[str, str]:
    env = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--vt-variant wants KEY=VAL[,KEY=VAL], got {text!r}")
        env[key.strip()] = value.strip()
    return env


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="a GGUF file (default: vt's default model)")
    ap.add_argument("--llama-bench", help="llama-bench binary (default: $LLAMA_BENCH, PATH)")
    ap.add_argument("--vt", default="vt", help="the vt command (default: vt)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; best kept")
    ap.add_argument("--repeat", type=int, default=1, help="repeats inside each run (1)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (2)")
    ap.add_argument("--under-load", action="store_true", help="also with 2 CPU hogs beside")
    ap.add_argument("--only-under-load", action="store_true", help="skip the quiet runs")
    ap.add_argument("--hogs", type=int, default=2, help="CPU-bound processes for --under-load")
    ap.add_argument(
        "--quiet-below",
        type=float,
        default=0.15,
        help="quiet runs start once the rest of the machine keeps less than this share "
        "of the CPUs busy (0.15)",
    )
    ap.add_argument(
        "--retry-noisy",
        type=int,
        default=2,
        help="quiet runs during which others kept more than --quiet-below busy are run "
        "again, at most this many times (2); every run is kept",
    )
    ap.add_argument("--quiet-wait-s", type=float, default=120, help="longest wait; 0: off")
    ap.add_argument("--load-max-s", type=float, default=3600, help="a hog's own time limit")
    ap.add_argument("--no-startup", dest="startup", action="store_false")
    ap.add_argument("--no-warm-up", dest="warm_up", action="store_false")
    ap.add_argument("--label", default="", help="free text kept in the JSON (vt's commit)")
    ap.add_argument("--vt-variant", action="append", default=[], metavar="KEY=VAL[,KEY=VAL]")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per engine run")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()

    argv = sys.argv[1:]
    args.vt = shlex.split(args.vt)
    args.variants = {v: parse_variant(v) for v in args.vt_variant}
    args.llama_bench = find_llama_bench(args.llama_bench)
    args.model = str(Path(args.model).expanduser().resolve()) if args.model else None
    args.model = args.model or default_model(args.vt)
    file_bytes = Path(args.model).stat().st_size

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # so the hogs' __exit__ runs

    signal.signal(signal.SIGTERM, stop)
    started = datetime.now(timezone.utc)
    warm = warm_up(args) if args.warm_up else {}
    conditions: dict[str, Any] = {}
    if not args.only_under_load:
        conditions["quiet"] = measure(args, "quiet")
    if args.under_load or args.only_under_load:
        with Hogs(args.hogs, args.load_max_s):
            conditions[f"{args.hogs}_cpu_hogs"] = measure(args, "load")

    summary: dict[str, Any] = {}
    for cond, res in conditions.items():
        shares = [b["others_cpu_share_mean"] for b in res["best"].values()]
        shares = [x for x in shares if x is not None]
        summary[f"{cond}.others_cpu_share"] = (
            round(sum(shares) / len(shares), 3) if shares else None
        )
        for name, ratios in res["ratio_vs_llama_cpp"].items():
            for key, value in ratios.items():
                summary[f"{cond}.{name}.{key}"] = value
    if "quiet" in conditions and len(conditions) > 1:
        loaded = conditions[f"{args.hogs}_cpu_hogs"]["best"]
        for name, b in conditions["quiet"]["best"].items():
            summary[f"load_vs_quiet.{name}.decode"] = _ratio(
                loaded[name].get("decode_tok_s"), b.get("decode_tok_s")
            )
    first = next(iter(conditions.values()))
    mem = memory(first["best"], file_bytes)
    for name, entry in mem.items():
        if isinstance(entry, dict):
            summary[f"memory.{name}.peak_rss_vs_file"] = entry["peak_rss_vs_file"]

    result = {
        "command": shlex.join(["python", "benchmarks/vs_llama_cpp.py", *argv]),
        "label": args.label,
        "vt_command": shlex.join(args.vt),
        "warm_up_wall_s": warm,
        "started_utc": started.isoformat(timespec="seconds"),
        "seconds": round((datetime.now(timezone.utc) - started).total_seconds()),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "model": {"path": args.model, "file_bytes": file_bytes},
        "llama_bench": args.llama_bench,
        "llama_cpp_threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "rounds": args.rounds,
        "vt_variants": args.variants,
        "ratios": summary,
        "memory": mem,
        "conditions": conditions,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
