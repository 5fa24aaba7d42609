"""Write a random-weight GGUF with SmolLM2-135M's shapes, for benchmarks without the model.

    python plugins/cuda/tools/write_smollm2_shape.py OUT.gguf [--weight-type Q4_1]

30 layers, dim 576, ffn 1536, 9 heads, 3 KV heads, vocab 49152, rope base 100000, context
8192; projections in ``--weight-type`` (SmolLM2's file: Q4_1), the tied embedding Q8_0.
:func:`vt.testing.tiny.write_tiny_gguf` learns its vocabulary from a short corpus, which
yields a few hundred tokens; the rest of the 49152 are filler tokens no merge produces, so
the tokenizer works and the tensor shapes are the real ones.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vt.testing import tiny

SMOLLM2_135M = {
    "n_layers": 30,
    "dim": 576,
    "ffn": 1536,
    "n_heads": 9,
    "n_kv_heads": 3,
    "vocab": 49152,
    "context_length": 8192,
    "rope_base": 100000.0,
}
_LEARNT = 300  # tokens tiny_vocab learns from its corpus (the tests' default)


def _padded_vocab(vocab: int) -> tuple[list[str], list[int], list[str]]:
    tokens, types, merges = _learnt(min(vocab, _LEARNT))
    tokens += [f"<filler{i}>" for i in range(vocab - len(tokens))]
    types += [1] * (vocab - len(types))
    return tokens, types, merges


_learnt = tiny.tiny_vocab


def write(path: Path, weight_type: str = "Q4_1") -> Path:
    tiny.tiny_vocab = _padded_vocab  # write_tiny_gguf looks it up at call time
    try:
        return tiny.write_tiny_gguf(
            path, arch="llama", weight_type=weight_type, embd_type="Q8_0", **SMOLLM2_135M
        )
    finally:
        tiny.tiny_vocab = _learnt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--weight-type", default="Q4_1")
    args = parser.parse_args()
    print(write(args.out, args.weight_type))


if __name__ == "__main__":
    main()
