"""What "verified before trusted" costs: opening a backend with its probes, cached, skipped.

    python -c "from vt.testing.tiny import write_tiny_gguf as w; w('/tmp/tiny.gguf', tied=False)"
    python benchmarks/verify_cost.py --repeat 5 --run-model /tmp/tiny.gguf \
        --json benchmarks/results-verify_cost.json

For each backend and repetition, a fresh ``VT_HOME`` and three fresh processes, as three
``vt run`` invocations would be: the first verifies (the probes run and the record is
written), the second reads the cached record, the third skips (``verify=False``). Each
process imports ``vt.model`` and discovers the plugins before the clock starts (``vt run``
does both with or without verification), then times ``vt.management.trust.open_verified_backend``.
Then, in one more process per backend, each probe of ``vt.management.audit.PROBES`` alone, to show
where the time goes. With ``--run-model PATH``, the wall time of whole ``vt run -n 8``
processes (first, cached, ``--no-verify``), where the difference is lost in noise on a
busy machine. Medians are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

OPEN = r"""
import json, sys, time
import vt.model, vt.management.registry
from vt.management.trust import open_verified_backend
vt.management.registry.default_registry().entries()
t = time.perf_counter()
backend, _, v = open_verified_backend(sys.argv[1], verify=sys.argv[2] == "1")
dt = time.perf_counter() - t
backend.close()
print(json.dumps({"open_s": dt, "status": v.status,
                  "probe_s": v.record.seconds if v.record else None}))
"""

PER_PROBE = r"""
import json, sys, time
from vt.management import audit, registry
backend, _ = registry.create_backend(sys.argv[1])
out = {}
try:
    for probe in audit.PROBES:
        t = time.perf_counter()
        checks = probe(backend)
        out[probe.__name__] = {"s": time.perf_counter() - t,
                               "results": [c.result for c in checks]}
finally:
    backend.close()
print(json.dumps(out))
"""


def child(code: str, *args: str, home: str) -> dict:
    env = dict(os.environ, VT_HOME=home)
    res = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(res.stdout)


def median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 1)


def open_cost(backend: str, repeat: int) -> dict:
    rows: dict[str, list[float]] = {"first": [], "probes": [], "cached": [], "skipped": []}
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as home:
            a = child(OPEN, backend, "1", home=home)
            b = child(OPEN, backend, "1", home=home)
            c = child(OPEN, backend, "0", home=home)
        assert (a["status"], b["status"], c["status"]) == ("verified", "cached", "skipped")
        rows["first"].append(a["open_s"])
        rows["probes"].append(a["probe_s"])
        rows["cached"].append(b["open_s"])
        rows["skipped"].append(c["open_s"])
    return {k: median_ms(v) for k, v in rows.items()}


def run_cost(backend: str, model: str, repeat: int) -> dict:
    rows: dict[str, list[float]] = {"first": [], "cached": [], "no-verify": []}
    said = {
        "first": "| verified in ",
        "cached": "| verified (cached) |",
        "no-verify": "| verification skipped (--no-verify) |",
    }
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as home:
            env = dict(os.environ, VT_HOME=home)
            for label in rows:
                extra = ["--no-verify"] if label == "no-verify" else []
                cmd = ["vt", "run", "-m", model, "-b", backend, "--raw", "-n", "8", *extra, "Hi"]
                t = time.perf_counter()
                res = subprocess.run(cmd, env=env, capture_output=True, text=True)
                rows[label].append(time.perf_counter() - t)
                assert res.returncode == 0 and said[label] in res.stderr, res.stderr
    return {k: round(statistics.median(v), 2) for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", nargs="+", default=["cpu", "tt_stub"])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--run-model", default=None, help="also time whole `vt run` processes")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    result: dict = {
        "repeat": args.repeat,
        "run_model": args.run_model,
        "load_before": os.getloadavg()[0],
        "backends": {},
    }
    for backend in args.backends:
        entry: dict = {"open_ms": open_cost(backend, args.repeat)}
        with tempfile.TemporaryDirectory() as home:
            per = child(PER_PROBE, backend, home=home)
        entry["probe_ms"] = {
            name: {"ms": round(v["s"] * 1e3, 1), "results": v["results"]} for name, v in per.items()
        }
        o = entry["open_ms"]
        print(
            f"{backend:8} open_verified_backend: first {o['first']} ms (probes {o['probes']} ms)"
            f" | cached {o['cached']} ms | skipped {o['skipped']} ms  (median of {args.repeat})"
        )
        print(
            "         per probe: "
            + ", ".join(
                f"{k.removeprefix('probe_')} {v['ms']}" for k, v in entry["probe_ms"].items()
            )
            + " ms"
        )
        if args.run_model:
            entry["vt_run_s"] = run_cost(backend, args.run_model, args.repeat)
            print(f"         vt run -n 8 wall (s): {entry['vt_run_s']}")
        result["backends"][backend] = entry
    result["load_after"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
