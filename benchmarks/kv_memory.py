"""Committed memory of the KV cache: a 200-token chat with --max-model-len 8192, vmm vs contiguous.

    python benchmarks/kv_memory.py [--backend cpu] [--tokens 200] [--max-model-len 8192]

Each KV kind runs in a fresh subprocess (so one run's memory cannot hide in the other's):
load the default model, chat until exactly ``--tokens`` tokens are generated (end-of-turn
ignored), then report the process's resident memory (RSS) and the KV cache's reserved and
mapped bytes. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, psutil, vt
kind, backend, tokens, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with vt.LLM(backend=backend, kv_cache=kind, max_model_len=max_len, max_slots=1) as llm:
    rss_loaded = psutil.Process().memory_info().rss
    params = vt.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    chat = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
    out = llm.chat(chat, params)[0]
    stats = llm.kv_cache_stats()
    rss = psutil.Process().memory_info().rss
print(json.dumps({"kind": kind, "generated": len(out.ids), "prompt_tokens": len(out.prompt_ids),
                  "rss_after_load_bytes": rss_loaded, "rss_after_chat_bytes": rss,
                  "kv_cache": stats.model_dump() if hasattr(stats, "model_dump") else stats}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--max-model-len", type=int, default=8192)
    args = ap.parse_args()
    runs = {}
    for kind in ("vmm", "contiguous"):
        cmd = [sys.executable, "-c", CHILD, kind, args.backend, str(args.tokens)]
        cmd.append(str(args.max_model_len))
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        runs[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    summary = {
        k: {
            "rss_after_chat_mib": round(r["rss_after_chat_bytes"] / mib, 1),
            "kv_reserved_mib": round(r["kv_cache"]["reserved_bytes"] / mib, 1),
            "kv_mapped_mib": round(r["kv_cache"]["mapped_bytes"] / mib, 1),
        }
        for k, r in runs.items()
    }
    print(
        json.dumps(
            {
                "command": f"python benchmarks/kv_memory.py --backend {args.backend} "
                f"--tokens {args.tokens} --max-model-len {args.max_model_len}",
                "summary": summary,
                "rss_saved_mib": round(
                    summary["contiguous"]["rss_after_chat_mib"]
                    - summary["vmm"]["rss_after_chat_mib"],
                    1,
                ),
                "runs": runs,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
