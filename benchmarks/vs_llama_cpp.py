"""vt against llama.cpp on the same machine, in one run: decode and prefill tokens/s.

    python benchmarks/vs_llama_cpp.py [--prompt-tokens 128] [--gen-tokens 64] [--threads 2]

Needs `pip install llama-cpp-python` (vt itself never depends on it). Runs llama.cpp and
then `vt bench`'s measurement (async readback on and off) on the default model, alternating
twice so that a noisy neighbour slows both sides alike, and prints one JSON object with
the best rate of each and the vt/llama.cpp ratios. Compare the ratios, not the absolute
numbers: this machine is shared.
"""

from __future__ import annotations

import argparse
import json
import time

from llama_cpp import Llama
from vt.bench import bench_prompt, run_bench
from vt.model import Tokenizer, load_gguf
from vt.model.cache import resolve_model


def llama_cpp_rates(path: str, prompt_ids: list[int], gen: int, threads: int) -> dict:
    llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt_ids)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(gen):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    decode_s = time.perf_counter() - t0
    return {"prefill_tok_s": len(prompt_ids) / prefill_s, "decode_tok_s": gen / decode_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args()
    path = str(resolve_model("default"))
    with load_gguf(path) as mf:
        prompt_ids = bench_prompt(Tokenizer.from_model(mf), args.prompt_tokens)

    best: dict[str, dict[str, float]] = {}

    def keep(name: str, rates: dict) -> None:
        cur = best.setdefault(name, {"prefill_tok_s": 0.0, "decode_tok_s": 0.0})
        for k in cur:
            if rates.get(k):
                cur[k] = max(cur[k], rates[k])

    vt_result = None
    for _ in range(2):
        vt_result = run_bench(
            model=path,
            backend=args.backend,
            prompt_tokens=args.prompt_tokens,
            gen_tokens=args.gen_tokens,
            repeat=2,
        )
        for run in vt_result.runs:
            name = "vt_async" if run.async_scheduling else "vt_sync"
            keep(name, run.model_dump())
        keep("llama_cpp", llama_cpp_rates(path, prompt_ids, args.gen_tokens, args.threads))

    assert vt_result is not None
    ref = best["llama_cpp"]
    out = {
        "command": "python benchmarks/vs_llama_cpp.py "
        f"--prompt-tokens {args.prompt_tokens} --gen-tokens {args.gen_tokens} "
        f"--threads {args.threads} --backend {args.backend}",
        "backend": vt_result.backend,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "llama_cpp_threads": args.threads,
        "best": {k: {m: round(v, 1) for m, v in r.items()} for k, r in best.items()},
        "ratio_vs_llama_cpp": {
            k: {m: round(v / ref[m], 3) for m, v in r.items()}
            for k, r in best.items()
            if k != "llama_cpp"
        },
        "vt_peak_rss_bytes": vt_result.peak_rss_bytes,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
