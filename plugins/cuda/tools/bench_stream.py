"""A batch-1 decode step's weight stream as one persistent launch: what it would gain.

    python plugins/cuda/tools/bench_stream.py [--layers 16] [--spin-ns 0,5000] [--check]

Needs cupy and an NVIDIA GPU of sm_90 or later (bulk copies into shared memory). Measures
docs/gpu.md's persistent decode plan before vt is rebuilt around it: the 1B shape's
weights (Q8_0's bytes: int8 codes and a half scale per 32 values, random) in its step's
order (per layer: q, k and v with the RMSNorm folded in, attention, o with the residual,
gate and up with the norm folded in and SiLU-mul, down with the residual; then the output
projection), run by ``bench_stream.cu``'s ``stream_step`` as:

- ``ring``: one launch a step, a block per multiprocessor; each phase waits for the one
  before (a counter per phase); every block copies its next weight chunks into a ring of
  shared-memory slots whenever one is free, across phases, so the memory keeps streaming
  while blocks wait or run attention's stand-in (``--spin-ns`` on 64 blocks, no weights);
- ``direct``: the same launch, the gemv phases reading their codes from global memory (the
  loads vt's gemv kernels issue);
- ``launches-ring``, ``launches-direct``: one launch a phase (a CUDA graph of them), no
  counters: the kernel boundaries vt's step has now.

Prints one JSON object per (variant, spin): microseconds a step (best of ``--repeat`` runs
of ``--steps`` steps), the weight bytes' rate and the steps a second; ``--check`` first
compares every variant's logits of a 2-layer step with a float64 reference (and the
variants with each other: the same sums in the same order, so the same bits).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

#: The 1B shape (Llama-3.2-1B): dim, q + k + v rows, ffn, vocab.
DIM, QKV, FFN, VOCAB = 2048, 3072, 8192, 128256
KINDS = {"gemv": 0, "swiglu": 1, "attention": 2}
PHASE = np.dtype(
    [
        ("kind", "<i4"),
        ("n", "<i4"),
        ("k", "<i4"),
        ("rc", "<i4"),
        ("nchunks", "<i4"),
        ("spin_ns", "<i4"),
        ("pad0", "<i4"),
        ("pad1", "<i4"),
        ("codes", "<u8"),
        ("scales", "<u8"),
        ("x", "<u8"),
        ("y", "<u8"),
        ("residual", "<u8"),
        ("nw", "<u8"),
    ]
)  # fmt: skip  (struct Phase in bench_stream.cu: 80 bytes)
WARPS = 16  # the kernel's consumer warps (a block: one more, the producer)


@dataclass
class Gemv:
    """One weight phase: ``rows`` x ``k`` codes, chunked ``rc`` rows at a time."""

    name: str
    kind: str
    rows: int
    k: int
    rc: int = 0

    @property
    def nchunks(self) -> int:
        return -(-self.rows // self.rc)

    @property
    def nbytes(self) -> int:
        return self.rows * self.k * 17 // 16  # codes and a 2-byte scale per 32


def rows_a_chunk(rows: int, k: int, blocks: int, slot_bytes: int, even: bool) -> int:
    """The fewest rows a chunk that still give every block as even a share as chunks of
    at most ``slot_bytes`` allow (``even``: a multiple of 2, gate and up rows in pairs)."""
    if k % 512 or k > 8192:  # a row's 16-value units: whole warps, at most the block
        raise ValueError(f"rows of {k} values: the kernel takes multiples of 512 up to 8192")
    most = min(slot_bytes // (k * 17 // 16), 16)
    if even:
        most -= most % 2
    if most < (2 if even else 1):
        raise ValueError(f"a slot of {slot_bytes} bytes holds no chunk of {k}-value rows")
    rounds = -(-rows // (blocks * most))
    rc = -(-rows // (blocks * rounds))
    return min(most, rc + rc % 2 if even else rc)


def layer_phases(layers: int) -> list[Gemv | str]:
    """The step's phases in order: Gemv for a weight, a name for a phase without one."""
    out: list[Gemv | str] = []
    if 5 * layers + 1 > 128:
        raise ValueError(f"{layers} layers: the kernel takes at most 128 phases (25 layers)")
    for i in range(layers):
        out += [
            Gemv(f"qkv{i}", "gemv", QKV, DIM),
            "attention",
            Gemv(f"o{i}", "gemv", DIM, DIM),
            Gemv(f"gate_up{i}", "swiglu", 2 * FFN, DIM),
            Gemv(f"down{i}", "gemv", DIM, FFN),
        ]
    return [*out, Gemv("output", "gemv", VOCAB, DIM)]


def reference(
    phases: list[Gemv | str],
    weights: dict[str, tuple[np.ndarray, np.ndarray]],
    norms: dict[str, np.ndarray],
    h: np.ndarray,
) -> np.ndarray:
    """The step in float64: what every variant computes (with the norm folded, late)."""
    h = h.astype(np.float64)
    x = h
    for ph in phases:
        if isinstance(ph, str):  # attention's stand-in: q passes through
            x = x[:DIM]
            continue
        codes, scales = weights[ph.name]
        w = codes.astype(np.float64) * np.repeat(scales.astype(np.float64), 32, axis=1)
        if ph.name.startswith(("qkv", "gate_up", "output")):  # the norm folded in
            nw = norms[ph.name]
            y = (w @ (h * nw)) / np.sqrt(np.mean(h * h) + 1e-5)
        else:
            y = w @ x
        if ph.kind == "swiglu":
            g, u = y[0::2], y[1::2]
            x = g / (1.0 + np.exp(-g)) * u
        elif ph.name.startswith(("o", "down")) and ph.name != "output":
            h = h + y
            x = h
        else:
            x = y
    return x


#: Shared memory a block may have on sm_90 (227 KB), less the kernel's static arrays.
SMEM_BYTES = 232_448 - 11_000
VARIANTS = ("ring", "direct", "launches-ring", "launches-direct")


def bad_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line, in a sentence, or None."""
    if not 1 <= args.slots <= 16:  # the kernel's mbarriers: 16 of each
        return f"--slots {args.slots}: the kernel has 1 to 16"
    if args.slot_kb < 1 or args.slots * args.slot_kb * 1024 + 4 * 8192 > SMEM_BYTES:
        return (f"--slots {args.slots} x --slot-kb {args.slot_kb}, with x's 32 KB, exceed "
                f"the {SMEM_BYTES // 1024} KB of shared memory a block may have")  # fmt: skip
    for name in ("layers", "steps", "repeat", "rows_div"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1"
    if args.layers > 25:
        return f"--layers {args.layers}: the kernel takes at most 128 phases (25 layers)"
    for d in args.define:
        name, _, value = d.partition("=")
        if name == "WARPS" and not (value.isdigit() and 1 <= int(value) <= 31):
            return f"--define {d}: consumer warps, 1 to 31 (a block of at most 1,024 threads)"
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        return f"unknown variants {sorted(unknown)}: {', '.join(VARIANTS)}"
    try:
        spins = [int(v) for v in args.spin_ns.split(",")]
    except ValueError:
        return f"--spin-ns {args.spin_ns!r}: nanoseconds, comma-separated"
    if any(not 0 <= v < 2**31 for v in spins):
        return f"--spin-ns {args.spin_ns}: each from 0 to 2**31 - 1"
    return None


def main() -> int:  # noqa: PLR0915 - one device run, top to bottom
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--spin-ns", default="0,5000", help="attention's stand-in, comma-separated")
    p.add_argument("--variants", default="ring,direct,launches-ring,launches-direct")
    p.add_argument("--slots", type=int, default=5)
    p.add_argument("--slot-kb", type=int, default=34)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--check", action="store_true", help="a 2-layer step against float64 first")
    p.add_argument(
        "--rows-div",
        type=int,
        default=1,
        help="every weight's rows / this (at least 16): the phases' chain without its bytes",
    )
    p.add_argument(
        "--no-wait",
        action="store_true",
        help="phases do not wait for the one before (wrong results; the stream's own rate)",
    )
    p.add_argument("--define", action="append", default=[], help="NAME=VALUE for the kernel")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    problem = bad_arguments(args)
    if problem:
        p.error(problem)
    import cupy as cp  # noqa: PLC0415 - after the arguments: --help needs no GPU

    warps = next((int(d.split("=")[1]) for d in args.define if d.startswith("WARPS=")), WARPS)
    threads = 32 * (warps + 1)
    src = (pathlib.Path(__file__).parent / "bench_stream.cu").read_text(encoding="utf-8")
    mod = cp.RawModule(
        code=src,
        options=("-std=c++17", "--gpu-architecture=sm_90", *(f"-D{d}" for d in args.define)),
        backend="nvrtc",
    )
    kernel = mod.get_function("stream_step")
    dev = cp.cuda.Device()
    blocks = dev.attributes["MultiProcessorCount"]
    slot_bytes = args.slot_kb * 1024
    dyn = args.slots * slot_bytes + 4 * 8192  # the slots, then x (rows of up to 8192)
    kernel.max_dynamic_shared_size_bytes = dyn
    stream = cp.cuda.Stream(non_blocking=True)

    def build(layers: int, div: int = 1) -> dict[str, Any]:
        phases = layer_phases(layers)
        cp.random.seed(0)
        weights, norms = {}, {}
        for ph in phases:
            if isinstance(ph, str):
                continue
            ph.rows = max(16, ph.rows // div // 2 * 2)
            ph.rc = rows_a_chunk(ph.rows, ph.k, blocks, slot_bytes, ph.kind == "swiglu")
            codes = cp.random.randint(-127, 128, (ph.rows, ph.k), dtype=cp.int32).astype(cp.int8)
            amp = 1.0 / (73.0 * np.sqrt(ph.k))  # outputs of about unit size
            scales = (cp.random.uniform(0.5, 1.5, (ph.rows, ph.k // 32)) * amp).astype(cp.float16)
            weights[ph.name] = (codes, scales)
            norms[ph.name] = cp.random.uniform(0.8, 1.2, DIM).astype(cp.float32)
        bufs = {
            n: cp.zeros(size, cp.float32)
            for n, size in (
                ("h", DIM),
                ("qkv", QKV),
                ("attn", DIM),
                ("act", FFN),
                ("logits", VOCAB),
            )
        }
        table = np.zeros(len(phases), PHASE)
        x_of = {"qkv": "h", "o": "attn", "gate_up": "h", "down": "act", "output": "h"}
        y_of = {"qkv": "qkv", "o": "h", "gate_up": "act", "down": "h", "output": "logits"}
        for i, ph in enumerate(phases):
            row = table[i]
            if isinstance(ph, str):
                row["kind"], row["n"] = KINDS["attention"], DIM
                row["x"], row["y"] = bufs["qkv"].data.ptr, bufs["attn"].data.ptr
                continue
            base = ph.name.rstrip("0123456789")
            codes, scales = weights[ph.name]
            row["kind"], row["n"], row["k"], row["rc"] = KINDS[ph.kind], ph.rows, ph.k, ph.rc
            row["nchunks"] = ph.nchunks
            row["codes"], row["scales"] = codes.data.ptr, scales.data.ptr
            row["x"], row["y"] = bufs[x_of[base]].data.ptr, bufs[y_of[base]].data.ptr
            if base in ("o", "down"):
                row["residual"] = bufs["h"].data.ptr
            if base in ("qkv", "gate_up", "output"):
                row["nw"] = norms[ph.name].data.ptr
        h0 = cp.random.standard_normal(DIM).astype(cp.float32)
        return {
            "phases": phases,
            "weights": weights,
            "norms": norms,
            "bufs": bufs,
            "h0": h0,
            "table": cp.asarray(table.view(np.uint8)),
            "n": len(phases),
            "counters": cp.zeros(len(phases), cp.int32),
            "err": cp.zeros(1, cp.int32),
        }

    def set_spin(st: dict[str, Any], spin: int) -> None:
        table = cp.asnumpy(st["table"]).view(PHASE)
        table["spin_ns"][table["kind"] == KINDS["attention"]] = spin
        st["table"][:] = cp.asarray(table.view(np.uint8))

    def step(st: dict[str, Any], variant: str, epoch: int) -> None:
        i32 = np.int32
        ring = (i32("ring" in variant), i32(args.slots), i32(slot_bytes), st["err"])
        ranges = (
            [(i, i + 1, 0) for i in range(st["n"])]
            if variant.startswith("launches")
            else [(0, st["n"], int(not args.no_wait))]
        )
        with stream:
            for p0, p1, wait in ranges:
                kernel(
                    (blocks,),
                    (threads,),
                    (st["table"], i32(p0), i32(p1), st["counters"], i32(epoch), i32(wait), *ring),
                    shared_mem=dyn,
                )

    def reset(st: dict[str, Any]) -> None:
        st["counters"][:] = 0
        st["err"][:] = 0
        st["bufs"]["h"][:] = st["h0"]

    results: list[dict[str, Any]] = []
    variants = args.variants.split(",")
    if args.check:
        st = build(2)
        set_spin(st, 1000)
        outs = {}
        for v in variants:
            reset(st)
            step(st, v, 1)
            stream.synchronize()
            outs[v] = cp.asnumpy(st["bufs"]["logits"])
            assert int(st["err"][0]) == 0, f"{v}: a counter wait timed out"
        ws = {n: (cp.asnumpy(c), cp.asnumpy(s)) for n, (c, s) in st["weights"].items()}
        ref = reference(
            st["phases"],
            ws,
            {n: cp.asnumpy(w) for n, w in st["norms"].items()},
            cp.asnumpy(st["h0"]),
        )
        for v, out in outs.items():
            nmse = float(np.mean((out - ref) ** 2) / np.mean(ref**2))
            row = {
                "check": v,
                "nmse_vs_float64": nmse,
                "bits_equal_to_first": bool(np.array_equal(out, outs[variants[0]])),
            }
            print(json.dumps(row), flush=True)
            results.append(row)
        del st
        cp.get_default_memory_pool().free_all_blocks()
    st = build(args.layers, args.rows_div)
    nbytes = sum(ph.nbytes for ph in st["phases"] if not isinstance(ph, str))
    graphs: dict[str, Any] = {}
    for spin in (int(s) for s in args.spin_ns.split(",")):
        set_spin(st, spin)
        graphs.clear()
        for v in variants:
            reset(st)
            epoch = 0
            if v.startswith("launches"):  # a graph of the step's launches, no host time
                with stream:
                    stream.begin_capture()
                    step(st, v, 0)
                    graphs[v] = stream.end_capture()

            def run(n: int, v: str = v) -> float:
                nonlocal epoch
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(stream)
                for _ in range(n):
                    epoch += 1
                    if v in graphs:
                        graphs[v].launch(stream)
                    else:
                        step(st, v, epoch)
                b.record(stream)
                b.synchronize()
                return cp.cuda.get_elapsed_time(a, b) * 1e3 / n

            run(2)
            us = min(run(args.steps) for _ in range(args.repeat))
            err = int(st["err"][0])
            row = {
                "variant": v,
                "layers": args.layers,
                "spin_ns": spin,
                "us_a_step": round(us, 1),
                "steps_s": round(1e6 / us, 1),
                "weight_GBps": round(nbytes / us / 1e3, 1),
                "weight_MB": round(nbytes / 1e6, 1),
                "slots": args.slots,
                "slot_kb": args.slot_kb,
                "defines": args.define,
                "no_wait": args.no_wait,
                "blocks": blocks,
                "timed_out_phase": err,
            }
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
