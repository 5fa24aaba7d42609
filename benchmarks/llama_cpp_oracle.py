"""Record llama.cpp's greedy token ids for the default model: the oracle for vt's ids.

Run (needs `pip install llama-cpp-python`, which vt itself never depends on):

    python benchmarks/llama_cpp_oracle.py MODEL.gguf > tests/fixtures/llama_cpp_greedy.json

For every prompt (raw completion, no chat template, no BOS as the model's metadata says)
it records the prompt ids, 32 greedy ids and, per step, the gap between the top two logits
so that a divergence can be judged a near-tie or a bug. It also prints llama.cpp's decode
speed on this machine to stderr as JSON.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from llama_cpp import Llama

PROMPTS = [
    "The capital of France is",
    "Why is the sky blue?",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "In machine learning, a neural network is",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Translate to French: Hello, how are you?",
    "The largest planet in the solar system is",
]
N_TOKENS = 32


def main(model_path: str) -> None:
    llm = Llama(model_path=model_path, n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    records = []
    decode_s = 0.0
    decoded = 0
    for prompt in PROMPTS:
        llm.reset()
        prompt_ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        llm.eval(prompt_ids)
        ids: list[int] = []
        gaps: list[float] = []
        for _ in range(N_TOKENS):
            logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            top2 = np.partition(logits, -2)[-2:]
            tok = int(np.argmax(logits))
            ids.append(tok)
            gaps.append(float(abs(top2[1] - top2[0])))
            t0 = time.perf_counter()
            llm.eval([tok])
            decode_s += time.perf_counter() - t0
            decoded += 1
        records.append(
            {
                "prompt": prompt,
                "prompt_ids": prompt_ids,
                "ids": ids,
                "top2_gaps": [round(g, 5) for g in gaps],
                "text": llm.detokenize(ids).decode("utf-8", errors="replace"),
            }
        )
    import llama_cpp

    out = {
        "engine": f"llama-cpp-python {llama_cpp.__version__}",
        "model_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "command": "python benchmarks/llama_cpp_oracle.py SmolLM2-135M-Instruct.Q4_1.gguf",
        "n_tokens": N_TOKENS,
        "records": records,
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    speed = {"engine": out["engine"], "threads": 2, "decode_tok_s": decoded / decode_s}
    print(json.dumps(speed), file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
