"""vt against llama.cpp on one GPU, in one run: decode at batch 1, 8 and 32, and prefill.

    python benchmarks/gpu_vs_llama_cpp.py --llama-src llama-src.tar.xz [--build-dir DIR]
        [--models smol,1b] [--backend cuda] [--out FILE] [--build-only [--server]] [--no-build]

Builds llama.cpp's ``llama-bench`` and ``llama-batched-bench`` with CUDA from the vendored
tree of the llama-cpp-python sdist (``--llama-src``: that tree, or a tar of it; skipped
when ``--build-dir`` already holds them; ``--build-only`` stops there, so a build can run
in the background while vt is measured; with ``--server`` it then builds ``llama-server``
too, for ``benchmarks/serve_vs_llama_server.py --backend cuda``), writes the random-weight
GGUFs of the real shapes (``plugins/cuda/tools/write_shape.py``: SmolLM2-135M Q4_1 with a
Q8_0 embedding, and Llama-3.2-1B Q8_0) unless they exist, then measures, alternating
engines per model:

- vt: ``vt bench --batch 1,8,32 --prompt-tokens 128 --gen-tokens 128 --repeat 2`` (aggregate
  decode tok/s per batch, async scheduling on) and ``vt bench --prompt-tokens 512
  --gen-tokens 16 --repeat 4`` (prefill tok/s of a 512-token prompt: the best of the
  repeats, and each repeat's, as the first runs eagerly and the second is captured where
  prefill steps replay; ``vt bench``'s engine runs without prefix caching, so every repeat
  computes its whole prompt);
- llama.cpp: ``llama-bench -p 512 -n 128 -ngl 99 -o json`` (pp512, tg128) and
  ``llama-batched-bench -npp 128 -ntg 128 -npl 1,8,32 -ngl 99`` (S_TG, the aggregate decode
  rate, per batch).

Prints one JSON object (and writes it to ``--out``) with the GPUs it ran on (``device``),
both sides' figures and ``ratios`` (vt / llama.cpp, above 1: vt faster) for every (model,
metric).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"smol": ("135m", "Q4_1"), "1b": ("1b", "Q8_0"), "1b-q4km": ("1b", "Q4_K_M")}
BATCHES = (1, 8, 32)
CMAKE_FLAGS = [
    "-G", "Ninja", "-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release",  # built only when asked
    # llama-server without its web UI: the device reaches no registry (npm, Hugging Face)
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
]  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw: Any) -> str:
    log("$ " + " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def build_llama(src: Path, build: Path, server: bool = False) -> tuple[Path, Path]:
    """``llama-bench`` and ``llama-batched-bench`` under ``build``, built unless present;
    with ``server``, ``llama-server`` after them (the benches are ready first)."""
    bench, batched = build / "bin" / "llama-bench", build / "bin" / "llama-batched-bench"
    if not (bench.exists() and batched.exists()):
        _build(src, build, "llama-bench", "llama-batched-bench")
    if server and not (build / "bin" / "llama-server").exists():
        _build(src, build, "llama-server")
    return bench, batched


def _build(src: Path, build: Path, *targets: str) -> None:
    """Configure ``build`` from ``src`` (a tree or a tar of one), then build ``targets``
    with ninja."""
    tree = src
    if src.is_file():  # a tar of the vendored tree
        tree = build.parent / "llama-src"
        if not (tree / "CMakeLists.txt").exists():
            tree.mkdir(parents=True, exist_ok=True)
            with tarfile.open(src) as tar:
                tar.extractall(tree, filter="data")
    t0 = time.monotonic()
    run(["cmake", "-S", str(tree), "-B", str(build), *CMAKE_FLAGS])
    jobs = str(os.cpu_count() or 4)
    run(["ninja", "-C", str(build), "-j", jobs, *targets])
    log(f"llama.cpp's {', '.join(targets)} built in {time.monotonic() - t0:.0f} s")


def gpu_names() -> list[str]:
    """The GPUs this run measured on (``nvidia-smi``'s name and memory), so a result file
    says which card gave it: sessions get an H200 or an H100."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"unknown (nvidia-smi: {exc})"]
    if done.returncode != 0:
        return [f"unknown (nvidia-smi exited {done.returncode})"]
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def model_path(name: str, folder: Path) -> Path:
    path = folder / f"{name}.gguf"
    if not path.exists():
        shape, wtype = SHAPES[name]
        tool = ROOT / "plugins" / "cuda" / "tools" / "write_shape.py"
        run([sys.executable, str(tool), str(path), "--shape", shape, "--weight-type", wtype])
    return path


def vt_prefill(model: Path, backend: str) -> dict[str, Any]:
    """pp512: the best of 4 prefills of a 512-token prompt (``vt bench`` runs its engine
    without prefix caching, so every repeat computes the whole prompt), and each repeat's
    rate with async scheduling on: where prefill steps replay as graphs, the first runs
    eagerly, the second is captured, the rest replay."""
    cmd = ["vt", "bench", "--backend", backend, "--model", str(model), "--json",
           "--prompt-tokens", "512", "--gen-tokens", "16", "--repeat", "4",
           "--max-model-len", "1024"]  # fmt: skip
    pre = json.loads(run(cmd))
    on = next(r for r in pre["runs"] if r["async_scheduling"])
    return {
        "prefill_pp512": max(r["prefill_tok_s"] for r in pre["runs"]),
        "prefill_pp512_each": on.get("prefill_tok_s_each", []),
        "prefill_graphs": on.get("prefill_graphs", False),
    }


def vt_figures(model: Path, backend: str) -> dict[str, Any]:
    common = ["vt", "bench", "--backend", backend, "--model", str(model), "--json"]
    batches = ",".join(map(str, BATCHES))
    batch = json.loads(run([*common, "--batch", batches, "--prompt-tokens", "128",
                            "--gen-tokens", "128", "--repeat", "2"]))  # fmt: skip
    out = {
        f"decode_b{r['batch']}": r["decode_tok_s"]
        for r in batch["batch_runs"]
        if r["async_scheduling"]
    }
    return {**out, **vt_prefill(model, backend)}


def llama_figures(model: Path, bench: Path, batched: Path) -> dict[str, float]:
    rows = json.loads(run([str(bench), "-m", str(model), "-p", "512", "-n", "128", "-ngl", "99",
                           "-o", "json"]))  # fmt: skip
    text = run([str(batched), "-m", str(model), "-c", "16384", "-npp", "128", "-ntg", "128",
                "-npl", ",".join(map(str, BATCHES)), "-ngl", "99"])  # fmt: skip
    return {**parse_llama_bench(rows), **parse_batched_bench(text)}


def parse_llama_bench(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``llama-bench -o json`` rows -> ``prefill_pp512`` and ``tg128`` (tok/s)."""
    out: dict[str, float] = {}
    for r in rows:
        if r.get("n_prompt") == 512 and not r.get("n_gen"):
            out["prefill_pp512"] = float(r["avg_ts"])
        if r.get("n_gen") == 128 and not r.get("n_prompt"):
            out["tg128"] = float(r["avg_ts"])
    return out


def parse_batched_bench(text: str) -> dict[str, float]:
    """``llama-batched-bench``'s table -> ``decode_bB``: S_TG (aggregate decode tok/s) of
    each batch B of 128 generated tokens. The table's columns: ``| PP | TG | B | N_KV |
    T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[0]) and cells[1] == "128":
            out[f"decode_b{int(cells[2])}"] = float(cells[7])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-src", type=Path, help="llama.cpp's tree, or a tar of it")
    ap.add_argument("--build-dir", type=Path, default=Path("/tmp/llama-build"))
    ap.add_argument("--models", default="smol,1b", help="comma-separated: smol, 1b, 1b-q4km")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--build-only", action="store_true", help="build llama.cpp, then stop")
    ap.add_argument("--no-build", action="store_true", help="fail unless already built")
    ap.add_argument("--server", action="store_true",
                    help="also build llama-server (after the benches)")  # fmt: skip
    ap.add_argument("--vt-prefill-only", action="store_true",
                    help="vt's pp512 of each model only (no llama.cpp)")  # fmt: skip
    args = ap.parse_args()
    if args.vt_prefill_only:
        figures = {m: vt_prefill(model_path(m, args.model_dir), args.backend)
                   for m in args.models.split(",")}  # fmt: skip
        print(json.dumps({"vt": figures}, indent=1))
        return
    if args.no_build:
        bench, batched = (
            args.build_dir / "bin" / n for n in ("llama-bench", "llama-batched-bench")
        )
        if not (bench.exists() and batched.exists()):
            raise SystemExit(f"llama.cpp is not built in {args.build_dir}")
    elif args.llama_src is None:
        raise SystemExit("--llama-src is needed to build llama.cpp")
    else:
        bench, batched = build_llama(args.llama_src, args.build_dir, server=args.server)
    if args.build_only:
        return
    result: dict[str, Any] = {"device": gpu_names(), "vt": {}, "llama.cpp": {}, "ratios": {}}
    for i, name in enumerate(args.models.split(",")):
        model = model_path(name, args.model_dir)
        first_vt = i % 2 == 0  # alternate which engine runs first
        for engine in ("vt", "llama.cpp") if first_vt else ("llama.cpp", "vt"):
            figures = (
                vt_figures(model, args.backend)
                if engine == "vt"
                else llama_figures(model, bench, batched)
            )
            result[engine][name] = figures
            log(f"{engine} {name}: {figures}")
        vt_f, ll_f = result["vt"][name], result["llama.cpp"][name]
        result["ratios"][name] = {k: round(vt_f[k] / ll_f[k], 3) for k in vt_f if ll_f.get(k)}
        if args.out:  # after each model, so a run cut short keeps what it measured
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
