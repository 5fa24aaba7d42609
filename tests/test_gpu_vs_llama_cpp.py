"""benchmarks/gpu_vs_llama_cpp.py reads llama.cpp's own output: its parsers, on a table of
the shape llama-batched-bench (0c1e570) prints; the S_TG figures are run 14's (docs/gpu.md),
the other cells only fill the shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_vs_llama_cpp as bench  # noqa: E402

BATCHED = """
main: n_kv_max = 16384, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.004 | 29557.51 |    0.157 |   817.76 |    0.161 |  1592.97 |
|   128 |    128 |    8 |   2048 |    0.020 | 51102.13 |    0.225 |  4558.36 |    0.245 |  8364.21 |
|   128 |    128 |   32 |   8192 |    0.081 | 50567.90 |    0.501 |  8182.93 |    0.582 | 14082.35 |

llama_perf_context_print:        load time =     100.00 ms
"""


def test_batched_bench_gives_the_aggregate_decode_rate_per_batch() -> None:
    assert bench.parse_batched_bench(BATCHED) == {
        "decode_b1": 817.76, "decode_b8": 4558.36, "decode_b32": 8182.93,
    }  # fmt: skip
    assert bench.parse_batched_bench("no table here\n| PP | TG |\n") == {}


def test_the_result_names_the_gpu_it_ran_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions get an H200 or an H100: the result file says which (nvidia-smi's name and
    memory), and says why it cannot where nvidia-smi fails or is missing."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 81559 MiB'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert bench.gpu_names() == ["NVIDIA H100 80GB HBM3, 81559 MiB"]
    smi.write_text("#!/bin/sh\nexit 9\n")
    assert bench.gpu_names() == ["unknown (nvidia-smi exited 9)"]
    smi.unlink()
    assert bench.gpu_names()[0].startswith("unknown (nvidia-smi: ")


def test_llama_bench_gives_pp512_and_tg128() -> None:
    rows = [
        {"n_prompt": 512, "n_gen": 0, "avg_ts": 52251.29},
        {"n_prompt": 0, "n_gen": 128, "avg_ts": 938.91},
        {"n_prompt": 128, "n_gen": 0, "avg_ts": 1.0},  # another test: not read
    ]
    assert bench.parse_llama_bench(rows) == {"prefill_pp512": 52251.29, "tg128": 938.91}


def test_the_q4_k_m_shape_is_llama_cpps_mix() -> None:
    """write_shape.py's Q4_K_M: Q6_K attn_v and ffn_down in llama.cpp's more-bits layers
    (the first and last eighth, every third between: 8 of 16), Q4_K elsewhere, and blocks
    that decode to finite values of about unit row variance."""
    import numpy as np
    import vt
    from gguf import GGMLQuantizationType as T

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins/cuda/tools"))
    import write_shape  # noqa: PLC0415

    kinds = [[write_shape.layer_type("Q4_K_M", name, i, 16) for i in range(16)]
             for name in ("attn_v", "ffn_down", "attn_q")]  # fmt: skip
    assert kinds[0] == kinds[1] and kinds[0].count(T.Q6_K) == 8 and set(kinds[2]) == {T.Q4_K}
    assert [i for i, t in enumerate(kinds[0]) if t == T.Q6_K] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert write_shape.layer_type("Q8_0", "attn_v", 0, 16) == T.Q8_0
    rng = np.random.default_rng(0)
    for qtype in (T.Q4_K, T.Q6_K):
        raw = write_shape.random_blocks(rng, 8, 512, qtype).reshape(-1)
        values = vt.reference.dequantize(vt.WeightTensor("w", int(qtype), (8, 512), raw))
        assert np.isfinite(values).all() and 0.3 < values.std() * np.sqrt(512) < 3


def test_bench_variant_sets_the_named_variant_and_passes_the_rest_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vt.gpu import GpuBackend
    from vt.gpu import modules as gpu_modules

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins/cuda/tools"))
    import bench_variant  # noqa: PLC0415

    for name in ("int8_min_rows", "attention_max_splits", "int8_mma", "native_fused",
                 "blas_inputs", "blas_min_rows", "compact_weights",
                 "layout_kernels"):  # fmt: skip
        monkeypatch.setattr(GpuBackend, name, getattr(GpuBackend, name))  # restored after
    monkeypatch.setattr(gpu_modules, "kernel_source", lambda parts=(): f"int x{len(parts)};")
    monkeypatch.setattr(GpuBackend, "overlap_launches", GpuBackend.overlap_launches)
    rest = bench_variant.apply(
        ["--int8-rows", "8", "--splits", "4", "--int8-mma", "0", "--no-fused", "--blas-f16",
         "--blas-min-rows", "99", "--kdefine", "VT_X=2", "--overlap", "0", "--compact", "0",
         "--layout-kernels", "0", "bench", "--batch", "1"]
    )  # fmt: skip
    assert rest == ["bench", "--batch", "1"]
    assert not GpuBackend.overlap_launches
    assert not GpuBackend.compact_weights and not GpuBackend.layout_kernels
    parts = gpu_modules.KERNEL_PARTS
    assert gpu_modules.kernel_source(("a.cu",)) == "#define VT_X 2\nint x1;"  # each source
    assert (GpuBackend.int8_min_rows, GpuBackend.attention_max_splits) == (8, 4)
    assert GpuBackend.int8_mma is False and GpuBackend.native_fused == frozenset()
    assert (GpuBackend.blas_inputs, GpuBackend.blas_min_rows) == ("f16", 99)
    assert gpu_modules.kernel_source() == f"#define VT_X 2\nint x{len(parts)};"
    monkeypatch.setattr(GpuBackend, "attention_last_block_combine", True)
    monkeypatch.setattr(GpuBackend, "attention_cluster", False)
    GpuBackend.native_fused = frozenset({"qkv", "swiglu", "qkv_rope_kv_store"})
    rest = bench_variant.apply(["--drop-fused", "qkv_rope_kv_store", "--drop-fused", "qkv",
                                "--add-fused", "rms_norm_swiglu", "--last-block-combine", "0",
                                "--attention-cluster", "1", "bench"])  # fmt: skip
    assert rest == ["bench"] and GpuBackend.attention_last_block_combine is False
    assert GpuBackend.attention_cluster is True
    assert GpuBackend.native_fused == frozenset({"swiglu", "rms_norm_swiglu"})
    numbers = {"attention_threads": 512, "deferred_norm_features": 4, "short_context": 512,
               "short_context_threads": 256}  # fmt: skip
    for name in numbers:
        monkeypatch.setattr(GpuBackend, name, getattr(GpuBackend, name))
    flags = [x for name, v in numbers.items() for x in (f"--{name.replace('_', '-')}", str(v))]
    assert bench_variant.apply([*flags, "bench"]) == ["bench"]
    assert {name: getattr(GpuBackend, name) for name in numbers} == numbers
    for flag, bad in (("--attention-threads", 100), ("--short-context-threads", 96)):
        with pytest.raises(SystemExit, match=f"{flag} takes one of .*, not {bad}"):
            bench_variant.apply([flag, str(bad), "bench"])
    assert {name: getattr(GpuBackend, name) for name in numbers} == numbers  # none changed


def test_kit_variant_runs_the_kit_on_cuda_with_the_variant_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """kit_variant.py sets the flags in its own process, then runs pytest on cuda with the
    arguments after ``--``; anything else is refused by name, before any test runs."""
    from vt.gpu import GpuBackend

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins/cuda/tools"))
    import kit_variant  # noqa: PLC0415

    for name in ("native_fused", "norm_late", "norm_fold_max_k"):
        monkeypatch.setattr(GpuBackend, name, getattr(GpuBackend, name))  # restored after
    runs: list[list[str]] = []
    monkeypatch.setattr(pytest, "main", lambda args: runs.append(args) or 0)
    flags = ["--add-fused", "rms_norm_swiglu", "--norm-late", "1", "--norm-fold-k", "1024"]
    assert kit_variant.main([*flags, "--", "-k", "e2e"]) == 0
    assert runs == [["-q", "-p", "no:cacheprovider", "-rfE", "--vt-backend", "cuda", "-k", "e2e"]]
    assert GpuBackend.norm_late and "rms_norm_swiglu" in GpuBackend.native_fused
    assert GpuBackend.norm_fold_max_k == 1024
    assert kit_variant.main(["--norm-late", "0", "--bogus"]) == 2
    assert "not a bench_variant.py flag: '--bogus'" in capsys.readouterr().err
    assert len(runs) == 1


def test_vt_prefill_keeps_the_best_repeat_and_each_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """pp512 is the best repeat of either async setting; the async-on run's repeats (eager,
    captured, replayed) travel with it."""
    runs = [
        {"async_scheduling": True, "prefill_tok_s": 110.0, "prefill_tok_s_each": [1.0, 20.0, 110.0],
         "prefill_graphs": True},
        {"async_scheduling": False, "prefill_tok_s": 120.0, "prefill_tok_s_each": [2.0, 120.0],
         "prefill_graphs": True},
    ]  # fmt: skip
    seen: list[list[str]] = []

    def run(cmd: list[str]) -> str:
        seen.append(cmd)
        return json.dumps({"runs": runs})

    monkeypatch.setattr(bench, "run", run)
    got = bench.vt_prefill(Path("m.gguf"), "cuda")
    assert got == {"prefill_pp512": 120.0, "prefill_pp512_each": [1.0, 20.0, 110.0],
                   "prefill_graphs": True}  # fmt: skip
    assert seen[0][seen[0].index("--repeat") + 1] == "4"


def test_bench_stream_cuts_each_weight_into_chunks_that_fit_a_slot() -> None:
    """bench_stream.py's chunks: every row of a phase in exactly one chunk, a chunk within
    its shared-memory slot and at most 16 rows, gate and up rows in pairs, and the blocks'
    shares as even as the slot allows; rows the kernel cannot take are refused by name."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins/cuda/tools"))
    import bench_stream  # noqa: PLC0415

    phases = [p for p in bench_stream.layer_phases(2) if not isinstance(p, str)]
    assert [p.name for p in phases] == [
        "qkv0", "o0", "gate_up0", "down0", "qkv1", "o1", "gate_up1", "down1", "output"
    ]  # fmt: skip
    assert sum(p.nbytes for p in bench_stream.layer_phases(16) if not isinstance(p, str)) == (
        1_312_980_992  # the 1B shape's Q8_0 bytes: 1.0625 a value
    )
    slot = 34 * 1024
    for p in phases:
        p.rc = bench_stream.rows_a_chunk(p.rows, p.k, 132, slot, p.kind == "swiglu")
        assert p.rc * p.k * 17 // 16 <= slot and 1 <= p.rc <= 16
        assert p.rc * (p.nchunks - 1) < p.rows <= p.rc * p.nchunks
        if p.kind == "swiglu":
            assert p.rc % 2 == 0
    assert {p.name: (p.rc, p.nchunks) for p in phases[:4]} == {
        "qkv0": (12, 256), "o0": (16, 128), "gate_up0": (16, 1024), "down0": (4, 512)
    }  # fmt: skip
    with pytest.raises(ValueError, match="rows of 576 values"):
        bench_stream.rows_a_chunk(960, 576, 132, slot, False)
    with pytest.raises(ValueError, match="holds no chunk of 8192-value rows"):
        bench_stream.rows_a_chunk(2048, 8192, 132, 8 * 1024, False)


def test_sass_count_reads_a_kernels_registers_from_ptxas_verbose_log() -> None:
    """sass_count.py's registers: the 'Used N registers' line after the named kernel's
    'Compiling entry function' line of ptxas's log; None where the log has no such line."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins/cuda/tools"))
    import sass_count  # noqa: PLC0415

    log = (
        "ptxas info    : Compiling entry function 'rms_norm' for 'sm_90'\n"
        "ptxas info    : Function properties for rms_norm\n"
        "ptxas info    : Used 43 registers, used 0 barriers, 1024 bytes smem\n"
        "ptxas info    : Compiling entry function 'attention_split' for 'sm_90'\n"
        "ptxas info    : Used 96 registers, used 1 barriers, 8192 bytes smem\n"
    )
    assert sass_count.registers(log, "attention_split") == 96
    assert sass_count.registers(log, "rms_norm") == 43
    assert sass_count.registers(log, "attention_combine") is None


def test_emulator_same_bits_names_the_cases_that_differ(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """emulate_kernels.py --same-bits: the outputs of the library as it is and with the
    define, compared bit for bit case by case (a -0.0 against +0.0 counts as different);
    the count of cases that differ is its result."""
    import numpy as np

    monkeypatch.syspath_prepend(Path(__file__).resolve().parent.parent / "plugins/cuda/tools")
    import emulate_kernels  # noqa: PLC0415

    built: list[tuple[str, ...]] = []

    def backend(libs: emulate_kernels.Libraries) -> tuple[object, None]:
        built.append(libs.extra)
        return type("B", (), {"defines": libs.extra})(), None

    monkeypatch.setattr(emulate_kernels, "emulated_backend", backend)

    def outputs(backend: object) -> list[tuple[str, np.ndarray]]:
        flip = "X=1" in backend.defines  # type: ignore[attr-defined]
        return [("a", np.array([1.0, 2.0], np.float32)),
                ("b", np.array([-0.0 if flip else 0.0], np.float32))]  # fmt: skip

    monkeypatch.setattr(emulate_kernels, "_bits_outputs", outputs)
    assert emulate_kernels.same_bits("X=1", ("Y=2",)) == 1
    assert built == [("Y=2",), ("Y=2", "X=1")]
    out = capsys.readouterr().out
    assert "same  a" in out and "DIFFERENT  b" in out
    assert "1 of 2 cases the same bits with X=1" in out


def test_emulator_settings_reach_both_sides_and_refuse_below_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """emulate_kernels.py --min-split / --attention-heads: the GpuBackend attributes of both
    libraries --same-bits compares; a value below 1 is refused by name before any compile."""
    monkeypatch.syspath_prepend(Path(__file__).resolve().parent.parent / "plugins/cuda/tools")
    import emulate_kernels  # noqa: PLC0415

    monkeypatch.setattr(emulate_kernels, "build", lambda folder, defines=(): defines)
    seen: list[tuple[int, int]] = []

    class Backend:
        attention_min_split, attention_max_group, attention_batch_max_group = 16, 2, 3

    monkeypatch.setattr(emulate_kernels, "emulated_backend", lambda lib: (Backend(), None))
    monkeypatch.setattr(
        emulate_kernels, "_bits_outputs",
        lambda b: seen.append(
            (b.attention_min_split, b.attention_max_group, b.attention_batch_max_group)
        ) or [],
    )  # fmt: skip
    argv = ["emulate_kernels.py", "--same-bits", "X=1", "--min-split", "64"]
    monkeypatch.setattr(sys, "argv", [*argv, "--attention-heads", "1"])
    with pytest.raises(SystemExit) as done:
        emulate_kernels.main()
    assert done.value.code == 0 and seen == [(64, 1, 1), (64, 1, 1)]
    for flag in ("--min-split", "--attention-heads"):
        monkeypatch.setattr(sys, "argv", ["emulate_kernels.py", flag, "0"])
        with pytest.raises(SystemExit):
            emulate_kernels.main()
        assert f"{flag} must be at least 1, not 0" in capsys.readouterr().err


def test_sass_count_counts_one_kernels_opcodes_predicated_or_not() -> None:
    """sass_count.py reads the named kernel's section of an nvdisasm listing only, and
    counts every instruction by opcode (a predicate and the modifiers left off); a kernel
    the listing lacks is an error naming it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins/cuda/tools"))
    import sass_count  # noqa: PLC0415

    listing = """
//--------------------- .text.other_kernel        --------------------------
        /*0000*/                   FADD R1, RZ, R2 ;          /* 0x0000000201017221 */
//--------------------- .text.swiglu_gemv2_q      --------------------------
        .section        .text.swiglu_gemv2_q,"ax",@progbits
.L_x_1:
        /*04d0*/                   I2F.S8 R30, R20 ;          /* 0x0000001400 */
        /*0550*/                   FMUL R30, R47, R30 ;       /* 0x0000001e2f */
        /*0570*/                   FADD R30, RZ, R30 ;        /* 0x0000001eff */
        /*05c0*/                   FFMA R30, R4.reuse, R30, R49 ;
        /*0430*/               @P0 BRA `(.L_x_3710) ;
        /*0440*/              @!PT LDS RZ, [RZ] ;
        /*0450*/                   FADD R31, RZ, R31 ;
//--------------------- .text.third_kernel        --------------------------
        /*0000*/                   EXIT ;
"""
    counts = sass_count.opcodes(listing, "swiglu_gemv2_q")
    assert counts == {"FADD": 2, "I2F": 1, "FMUL": 1, "FFMA": 1, "BRA": 1, "LDS": 1}
    with pytest.raises(KeyError, match="no kernel 'absent_kernel'"):
        sass_count.opcodes(listing, "absent_kernel")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slots", "17"], "--slots 17: the kernel has 1 to 16"),
        (["--slots", "6", "--slot-kb", "34"], "exceed the 216 KB of shared memory"),
        (["--rows-div", "0"], "--rows-div 0: at least 1"),
        (["--layers", "26"], "at most 128 phases (25 layers)"),
        (["--variants", "ring,fast"], "unknown variants ['fast']"),
        (["--spin-ns", "5us"], "--spin-ns '5us': nanoseconds"),
        (["--define", "WARPS=40"], "--define WARPS=40: consumer warps, 1 to 31"),
    ],
)
def test_bench_stream_refuses_bad_arguments_before_it_needs_a_gpu(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Arguments the kernel cannot take (mbarriers, shared memory, phases) are refused by
    name, as argparse errors, before cupy is imported or anything is compiled."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins/cuda/tools"))
    import bench_stream  # noqa: PLC0415

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["bench_stream.py", *argv])
        with pytest.raises(SystemExit) as info:
            bench_stream.main()
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_stream_takes_its_defaults_and_the_measured_sweeps() -> None:
    """The defaults (5 slots of 34 KB) and run 66's sweeps (3-5 slots, 8-31 warps) pass."""
    import argparse

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins/cuda/tools"))
    import bench_stream  # noqa: PLC0415

    variants = ",".join(bench_stream.VARIANTS)
    base = {"slots": 5, "slot_kb": 34, "layers": 16, "steps": 20, "repeat": 3, "rows_div": 1,
            "variants": variants, "spin_ns": "0,5000", "define": []}  # fmt: skip
    for change in ({}, {"slots": 3}, {"define": ["WARPS=8"]}, {"define": ["WARPS=31"]}):
        assert bench_stream.bad_arguments(argparse.Namespace(**(base | change))) is None


def test_sass_count_names_a_kernel_the_source_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel name the machine code lacks (a typo, or a define that leaves it out) stops
    the tool with one line naming it and the compile options, not a traceback."""
    import subprocess
    import types

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins/cuda/tools"))
    import sass_count  # noqa: PLC0415

    listing = "//--------------------- .text.matmul_gemv2_q ----\n  /*0000*/  EXIT ;\n"
    monkeypatch.setattr(sass_count, "cubin", lambda source, options: (b"", ""))
    monkeypatch.setattr(sass_count, "nvdisasm", lambda: "nvdisasm")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=listing))
    with pytest.raises(SystemExit, match="no kernel 'swiglu_gemv9_q' in the machine code"):
        sass_count.main(["swiglu_gemv9_q", "-D", "VT_Q_FLAGS=0xc00"])


def test_sass_count_writes_the_kernels_listing_where_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--listing FILE: the named kernel's section of the machine code, no other kernel's,
    beside the counts on stdout."""
    import subprocess
    import types

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins/cuda/tools"))
    import sass_count  # noqa: PLC0415

    listing = (
        "//--------------------- .text.matmul_gemv2_q ----\n  /*0000*/  FADD R1, R2, R3 ;\n"
        "//--------------------- .text.swiglu_gemv2_q ----\n  /*0000*/  EXIT ;\n"
    )
    monkeypatch.setattr(sass_count, "cubin", lambda source, options: (b"", ""))
    monkeypatch.setattr(sass_count, "nvdisasm", lambda: "nvdisasm")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=listing))
    out = tmp_path / "k.sass"
    assert sass_count.main(["matmul_gemv2_q", "--listing", str(out)]) == 0
    text = out.read_text()
    assert "FADD R1, R2, R3" in text and "swiglu_gemv2_q" not in text


def test_profile_decode_tables_kernels_by_launch_shape() -> None:
    """profile_decode.py's table per (kernel, grid) from a Chrome trace: one kernel's launch
    shapes apart (o and down against the output projection), calls and microseconds a step,
    the means of the faster and the slower half of a shape's calls (o's and down's), the
    last registers and occupancy seen; events that are not kernels are left out."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins/cuda/tools"))
    import profile_decode  # noqa: PLC0415

    def kernel(name: str, grid: list[int], dur: float) -> dict:
        args = {"grid": grid, "registers per thread": 40, "est. achieved occupancy %": 75}
        return {"cat": "kernel", "name": name, "dur": dur, "args": args}

    trace = {"traceEvents": [
        kernel("matmul_gemv2_q", [1024, 1, 1], 6.0), kernel("matmul_gemv2_q", [1024, 1, 1], 7.0),
        kernel("matmul_gemv2_q", [64128, 1, 1], 110.0),
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "dur": 50.0, "args": {}},
    ]}  # fmt: skip
    head, first, second = profile_decode.by_grid(trace, steps=2)
    assert head.split()[:2] == ["kernel", "grid"]
    assert first.split() == ["matmul_gemv2_q", "64128x1x1", "0.5", "55.0", "110.00", "110.00",
                             "110.00", "40", "75"]  # fmt: skip
    # two projections on one shape: the faster and the slower half of the calls
    assert second.split() == ["matmul_gemv2_q", "1024x1x1", "1.0", "6.5", "6.50", "6.00", "7.00",
                              "40", "75"]  # fmt: skip


def test_bench_variant_sets_the_gemv_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """--gemv-threads, --gemv-swiglu-threads, --gemv-swiglu-features and --gemv-wide-*: the
    GpuBackend settings of runs 74-77's and 88's variants, the rest of the command line passed
    on."""
    from vt.gpu import GpuBackend

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins/cuda/tools"))
    import bench_variant  # noqa: PLC0415

    names = ("gemv_threads", "gemv_swiglu_threads", "gemv_wide_min_rows",
             "gemv_wide_features", "gemv_wide_threads", "gemv_swiglu_features")  # fmt: skip
    for name in names:
        monkeypatch.setattr(GpuBackend, name, getattr(GpuBackend, name))  # restored after
    rest = bench_variant.apply(
        ["--gemv-threads", "64", "--gemv-swiglu-threads", "32", "--gemv-wide-rows", "0",
         "--gemv-wide-features", "2", "--gemv-wide-threads", "128",
         "--gemv-swiglu-features", "4", "bench"]
    )  # fmt: skip
    assert rest == ["bench"]
    assert [getattr(GpuBackend, n) for n in names] == [64, 32, 0, 2, 128, 4]


def test_bench_variant_skips_the_kernels_a_prefix_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """--skip-kernel PREFIX (a diagnostic): no launch of a kernel whose name starts with it;
    every other kernel still launches."""
    from vt.gpu import GpuBackend

    monkeypatch.syspath_prepend(Path(__file__).resolve().parent.parent / "plugins/cuda/tools")
    monkeypatch.syspath_prepend(Path(__file__).resolve().parent)  # fake_gpu
    import bench_variant  # noqa: PLC0415
    from fake_gpu import make  # noqa: PLC0415

    monkeypatch.setattr(GpuBackend, "_kernel", GpuBackend._kernel)  # restored after
    assert bench_variant.apply(["--skip-kernel", "rms_norm", "bench"]) == ["bench"]
    for flag in ("--skip-kernel", "--overlap-combine", "--kdefine"):  # a flag with no value
        with pytest.raises(SystemExit, match=f"{flag} needs a value"):
            bench_variant.apply([flag])
    backend, rt = make()
    stream = backend.create_stream()
    x = backend.alloc(4 * 64)
    backend._kernel("rms_norm", (1, 1, 1), 64, stream, x)
    backend._kernel("add", (1, 1, 1), 64, stream, x)
    assert [launch.kernel for launch in rt.launches] == ["add"]
    backend.close()


def test_ncu_table_reads_the_raw_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ncu_table.py: a line per profiled launch from ``ncu --csv --page raw`` (header, units,
    launches; the program's own output before it), time in microseconds whatever the unit
    (``ns`` as ncu 2025 writes it, ``nsecond`` as older ones), memory throughput from DRAM's
    metric or else SpeedOfLight's, the stall reasons largest first; a metric the report lacks
    prints as '-'; a file with no report or a time in an unknown unit is a clear error."""
    monkeypatch.syspath_prepend(Path(__file__).resolve().parent.parent / "plugins/cuda/tools")
    import ncu_table  # noqa: PLC0415

    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    header = ["ID", "Kernel Name", "Block Size", "Grid Size", "gpu__time_duration.sum",
              "launch__registers_per_thread", stall.format("barrier"),
              stall.format("long_scoreboard"), stall.format("no_instruction"),
              "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"]  # fmt: skip
    units = ["", "", "", "", "ns", "register/thread", "ratio", "ratio", "ratio", "%"]
    launch = ["0", "attention_split", "(128, 1, 1)", "(1, 8, 32)", "7,780", "96", "3.5",
              "12.25", "0", "0.55"]  # fmt: skip
    report = tmp_path / "ncu.csv"
    report.write_text("vt bench output\n==PROF== Connected\n" + "\n".join(
        ",".join(f'"{c}"' for c in row) for row in (header, units, launch)) + "\n")  # fmt: skip
    head, line = ncu_table.table(report.read_text().splitlines()[2:])
    assert head.split()[:3] == ["kernel", "grid", "block"]
    cells, stalls = line.split(" | ")
    cells = cells.split()
    assert cells[:6] == ["attention_split", "(1,8,32)", "128", "7.78", "0.55", "-"]
    assert cells[6:] == ["96.00", "-", "-", "-", "-"]
    assert stalls == "long_scoreboard 12.2, barrier 3.5"  # no_instruction 0: left out

    monkeypatch.setattr(sys, "argv", ["ncu_table.py", str(report)])
    ncu_table.main()  # finds the report past the program's output
    report.write_text("==PROF== Disconnected\n")
    with pytest.raises(SystemExit, match="no ncu CSV report"):
        ncu_table.main()
    with pytest.raises(ValueError, match="Kernel Name"):
        ncu_table.table(['"ID","x"', '"",""'])
    old_units = ",".join(f'"{c}"' for c in ["", "", "", "", "nsecond"] + units[5:])
    rows = [",".join(f'"{c}"' for c in row) for row in (header, launch)]
    assert ncu_table.table([rows[0], old_units, rows[1]])[1].split()[3] == "7.78"
    with pytest.raises(ValueError, match="unknown unit 'fortnight'"):
        ncu_table.table([rows[0], old_units.replace("nsecond", "fortnight"), rows[1]])


def test_nsys_steps_adds_up_a_replayed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nsys_steps.py: the trace cut into steps at the --first kernel, only the most common
    sequence kept (a prefill step left out), and per kernel its increment, how much later
    the step ends because of it: an overlapped kernel that ends inside its predecessor adds
    nothing, and the increments add up to the step's span. A trace without the first kernel,
    or a file that is no trace, is a clear error."""
    monkeypatch.syspath_prepend(Path(__file__).resolve().parent.parent / "plugins/cuda/tools")
    import nsys_steps  # noqa: PLC0415

    rows = ['"Start (ns)","Duration (ns)","CorrId","Name"']
    # a prefill step (other kernels), then two decode steps of 4 activities each (ns)
    trace = [(0, 50_000, "embedding_q"), (60_000, 40_000, "matmul_tiled_q")]
    for t0 in (200_000, 300_000):
        trace += [(t0, 4_000, "embedding_q"), (t0 + 5_000, 10_000, "swiglu_gemv2_q"),
                  (t0 + 7_000, 6_000, "rms_norm"), (t0 + 16_000, 2_000, "sample")]  # fmt: skip
    rows += [f'"{s:,}","{d:,}","7","{n}"' for s, d, n in trace]
    report = nsys_steps.report(nsys_steps.steps(nsys_steps.activities(rows), "embedding"))
    assert report["steps"] == 2 and report["activities_per_step"] == 4
    assert report["span_us"] == 18.0  # 0 .. 16 + 2
    inc = {b["name"]: b["inc"] for b in report["per_name"]}
    # embedding 4; swiglu 15 - 4 = 11; rms_norm ends at 13 < 15: 0; sample 18 - 15 = 3
    assert inc == {"embedding_q": 4.0, "swiglu_gemv2_q": 11.0, "rms_norm": 0.0, "sample": 3.0}
    assert sum(inc.values()) == report["span_us"]
    gaps = [p["gap"] for p in report["per_position"]]
    assert gaps == [0.0, 1.0, -8.0, 1.0]  # rms_norm starts 8 us before swiglu ends
    lines = nsys_steps.table(report)
    assert lines[0].startswith("2 steps of 4 activities, 18.0 us a step")
    assert lines[2].split()[:3] == ["swiglu_gemv2_q", "1", "11.00"]

    path = tmp_path / "trace.csv"
    path.write_text("\n".join(rows) + "\n")
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["nsys_steps.py", str(path), "--json", str(out)])
    nsys_steps.main()
    assert json.loads(out.read_text())["span_us"] == 18.0
    monkeypatch.setattr(sys, "argv", ["nsys_steps.py", str(path), "--first", "attention"])
    with pytest.raises(SystemExit, match="no activity named 'attention'"):
        nsys_steps.main()
    path.write_text('"Time","Name"\n"1","x"\n')
    monkeypatch.setattr(sys, "argv", ["nsys_steps.py", str(path)])
    with pytest.raises(SystemExit, match="no column starting with 'Start'"):
        nsys_steps.main()


def test_torch_trace_writes_what_nsys_steps_reads(tmp_path: Path) -> None:
    """torch_trace.py: the GPU activities of PyTorch's chrome trace (kernels, copies,
    memsets; microseconds) as nsys_steps.py's columns in nanoseconds, by start; CPU events
    and events without a duration are left out."""
    tools = Path(__file__).resolve().parent.parent / "plugins/cuda/tools"
    sys.path.insert(0, str(tools))
    import nsys_steps  # noqa: PLC0415
    import torch_trace  # noqa: PLC0415

    events = [
        {"cat": "kernel", "name": "swiglu_gemv2_q", "ts": 105.5, "dur": 10.25},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 3.0},
        {"cat": "kernel", "name": "embedding_q", "ts": 100.0, "dur": 4.0},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 120.0, "dur": 1.0},
        {"cat": "kernel", "name": "no_duration", "ts": 130.0},
    ]
    rows = torch_trace.gpu_rows(events)
    assert rows == [(100_000, 4_000, "embedding_q"), (105_500, 10_250, "swiglu_gemv2_q"),
                    (120_000, 1_000, "Memcpy DtoH (Device -> Pinned)")]  # fmt: skip
    path = tmp_path / "trace.csv"
    torch_trace.write_csv(path, rows)
    acts = nsys_steps.activities(path.read_text().splitlines())
    assert acts == [("embedding_q", 100.0, 4.0), ("swiglu_gemv2_q", 105.5, 10.25),
                    ("Memcpy DtoH (Device -> Pinned)", 120.0, 1.0)]  # fmt: skip


def test_torch_trace_without_a_cuda_device_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch_trace.py's imports (vt's CLI among them: run 88's trace died on a wrong one)
    resolve, and with no CUDA device it says so instead of recording nothing."""
    import types  # noqa: PLC0415

    tools = Path(__file__).resolve().parent.parent / "plugins/cuda/tools"
    monkeypatch.syspath_prepend(str(tools))
    import torch_trace  # noqa: PLC0415

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_available=lambda: False)  # type: ignore[attr-defined]
    profiler = types.ModuleType("torch.profiler")
    profiler.ProfilerActivity = object  # type: ignore[attr-defined]
    profiler.profile = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.profiler", profiler)
    monkeypatch.setattr(sys, "argv", ["torch_trace.py", str(tmp_path / "t.csv"), "bench"])
    with pytest.raises(SystemExit, match="PyTorch sees no CUDA device"):
        torch_trace.main()


def test_build_builds_llama_server_after_the_benches_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--build-only --server``: the benches first (a side by side waiting for them is not
    held up by the server), then llama-server; nothing already built is built again."""
    (tmp_path / "src").mkdir()
    build = tmp_path / "build"
    ninja: list[list[str]] = []

    def run(cmd: list[str]) -> str:
        if cmd[0] == "ninja":
            ninja.append(cmd[5:])
            (build / "bin").mkdir(parents=True, exist_ok=True)
            for target in cmd[5:]:
                (build / "bin" / target).touch()
        return ""

    monkeypatch.setattr(bench, "run", run)
    assert bench.build_llama(tmp_path / "src", build) == (
        build / "bin" / "llama-bench",
        build / "bin" / "llama-batched-bench",
    )
    assert ninja == [["llama-bench", "llama-batched-bench"]]
    bench.build_llama(tmp_path / "src", build, server=True)
    assert ninja[1:] == [["llama-server"]]
    bench.build_llama(tmp_path / "src", build, server=True)
    assert len(ninja) == 2
    assert "-DLLAMA_BUILD_SERVER=ON" in bench.CMAKE_FLAGS


def test_serve_bench_runs_vt_on_the_backend_and_llama_server_with_its_options() -> None:
    """On a GPU: ``vt serve --backend cuda`` (the baseline too) against ``llama-server``
    with ``-ngl 99``; on CPU, the defaults it always had."""
    import argparse

    import serve_vs_llama_server as serve

    args = argparse.Namespace(
        backend="cuda", llama_args="-ngl 99", slots=64, ctx_per_slot=1024, threads=8,
        vt_baseline="/old/bin/vt", vt_baseline_args="--no-prefix-caching",
    )  # fmt: skip
    cmds = serve.server_commands(args, ["vt"], "/b/llama-server", "/m.gguf")
    vt, llama, base = (cmds[n][1] for n in ("vt", "llama_server", "vt_baseline"))
    assert vt[:4] == ["vt", "serve", "--backend", "cuda"]
    assert vt[vt.index("--max-slots") + 1] == "64" and "/m.gguf" in vt
    assert llama[-2:] == ["-ngl", "99"] and llama[llama.index("-c") + 1] == str(64 * 1024)
    assert base[:4] == ["/old/bin/vt", "serve", "--backend", "cuda"]
    assert base[-1] == "--no-prefix-caching"
    assert len({cmds[n][2] for n in cmds}) == 3  # a port each
    args.backend, args.llama_args, args.vt_baseline = "cpu", "", None
    cmds = serve.server_commands(args, ["vt"], "/b/llama-server", "/m.gguf")
    assert set(cmds) == {"vt", "llama_server"}
    assert cmds["vt"][1][3] == "cpu" and cmds["llama_server"][1][-1] == "--no-webui"


def test_first_load_alternates_the_compile_settings_and_means_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """first_load.py and compile_time.py: off then on, flipped every other round, a mean
    per setting; fewer than one round is refused."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins/cuda/tools"))
    import first_load

    seen: list[bool] = []

    def run(parallel: bool) -> dict:
        seen.append(parallel)
        return {"s": 2.0 if parallel else 4.0 + len(seen)}

    runs, mean = first_load.alternate(2, run, "s")
    assert seen == [False, True, True, False]
    assert [r["parallel_compile"] for r in runs] == seen
    assert mean == {"False": (5.0 + 8.0) / 2, "True": 2.0}
    with pytest.raises(SystemExit, match="--rounds must be at least 1, got 0"):
        first_load.alternate(0, run, "s")


def test_first_load_child_runs_with_empty_caches_and_reads_each_modules_compile() -> None:
    """first_load.child: the child has vt's kernel cache off and an empty CUDA compute cache
    of its own (NVRTC 13 answers repeats from it: run 134), and each module's announced
    compile time comes back beside the child's JSON; a failed child names its error."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins/cuda/tools"))
    import first_load

    code = (
        "import json, os, sys\n"
        "print('vt: compiling cuda kernels a.cu (VT_KERNEL_CACHE=0: every run)...', "
        "file=sys.stderr)\n"
        "print('vt: cuda kernels a.cu ready in 16 s', file=sys.stderr)\n"
        "print('vt: cuda kernels b_other.cu ready in 8 s', file=sys.stderr)\n"
        "nv = os.environ['CUDA_CACHE_PATH']\n"
        "print(json.dumps({'load_s': 1.23456, 'cache': os.environ['VT_KERNEL_CACHE'], "
        "'nv_empty': os.path.isdir(nv) and not os.listdir(nv), 'arg': sys.argv[1]}))\n"
    )
    out = first_load.child(code, "x")
    assert out == {"load_s": 1.23, "cache": "0", "nv_empty": True, "arg": "x",
                   "modules_s": {"a.cu": 16, "b_other.cu": 8}}  # fmt: skip
    with pytest.raises(SystemExit, match=r"the run failed \(1\):[\s\S]*ZeroDivisionError"):
        first_load.child("1 / 0")


def test_h200_checks_cmd_runs_a_command_with_the_steps_environment(tmp_path: Path) -> None:
    """h200_checks.sh cmd: $CMD with what every step has (the carried wheels on PYTHONPATH,
    VT_HOME), logged, its status in summary.txt; without CMD it says what is missing."""
    script = Path(__file__).resolve().parents[1] / "plugins/cuda/tools/h200_checks.sh"
    env = {**os.environ, "OUT": str(tmp_path), "CMD": 'echo "$PYTHONPATH $VT_HOME"'}
    env.pop("VT_HOME", None)
    done = subprocess.run(["bash", str(script), "cmd"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "/tmp/site" in done.stdout and "/tmp/vt-home" in done.stdout
    assert (tmp_path / "summary.txt").read_text().startswith("cmd rc=0 ")
    del env["CMD"]
    done = subprocess.run(["bash", str(script), "cmd"], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "set CMD to the command" in done.stderr


@pytest.mark.parametrize(
    ("kvars", "want"),
    [("", [""]), ("|a|", ["", "a", ""]), ("|a||a", ["", "a", "", "a"]), ("a|b", ["a", "b"])],
)
def test_h200_checks_kvars_runs_every_variant_a_trailing_tree_too(
    tmp_path: Path, kvars: str, want: list[str]
) -> None:
    """h200_checks.sh kvars: one bench per '|'-separated variant of KVARS, in order; an
    empty one is the tree, at the end too (run 176 lost a trailing one to bash's read)."""
    script = Path(__file__).resolve().parents[1] / "plugins/cuda/tools/h200_checks.sh"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"  # a bench that only says which variant it was given
    fake.write_text('#!/bin/sh\necho "fake python3 $*" >> "$OUT/calls.txt"\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "KVARS": kvars, "KTAG": f"t{os.getpid()}",
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}  # fmt: skip
    try:
        done = subprocess.run(
            ["bash", str(script), "kvars:none"], env=env, capture_output=True, text=True
        )
    finally:  # the step keeps each bench's JSON in /tmp, as on the device
        for left in Path("/tmp").glob(f"kvars-none*{env['KTAG']}*.json"):
            left.unlink()
    assert done.returncode == 0, done.stderr
    benches = [
        line.split("bench_variant.py", 1)[1].split(" bench --backend", 1)[0].strip()
        for line in (out / "calls.txt").read_text().splitlines()
        if "bench_variant.py" in line
    ]
    assert benches == want


def test_sass_same_compares_listings_without_labels_and_numbered_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sass_same.py's listings: each kernel's instructions with addresses, labels and
    nvrtc's numbered internal names taken out, so the same code in two units compares
    equal, and a changed instruction does not."""
    monkeypatch.syspath_prepend(Path(__file__).resolve().parent.parent / "plugins/cuda/tools")
    import sass_same  # noqa: PLC0415

    def unit(label: int, internal: int, op: str) -> str:
        return (
            '\t.section\t.text.add,"ax",@progbits\n'
            ".text.add:\n"
            f"        /*0000*/                   {op} R1, R2, R3 ;\n"
            f"        /*0010*/                   BRA `(.L_x_{label}) ;\n"
            f"        /*0020*/                   CALL.REL.NOINC `($__internal_{internal}_$x) ;\n"
            f".L_x_{label}:\n"
            "//--------------------- .text.next --------------------------\n"
            '\t.section\t.text.next,"ax",@progbits\n'
            ".text.next:\n"
            "        /*0000*/                   EXIT ;\n"
        )

    a, b = sass_same.listings(unit(12, 7, "FADD")), sass_same.listings(unit(99, 17, "FADD"))
    assert a == b and set(a) == {"add", "next"}
    assert a["add"] == ["FADD R1, R2, R3 ;", "BRA `(L) ;", "CALL.REL.NOINC `($__internal_$x) ;"]
    assert sass_same.listings(unit(12, 7, "FMUL"))["add"] != a["add"]
