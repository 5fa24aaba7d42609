"""The conformance kit: `pytest --vt-backend NAME` on cpu and tt_stub, planted faults, matrix.

The kit runs in subprocesses, as a backend author's CI runs it: from an empty directory with
its own pytest.ini, the plugin loaded through vt's ``pytest11`` entry point.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from vt import OPS
from vt.frontends.cli import main
from vt.management.registry import Registry
from vt.model.graph import SUPPORTED_ARCHITECTURES
from vt.testing.contracts_suite import CONTRACTS
from vt.testing.kit import (
    CORE_METHODS,
    KitCase,
    KitContext,
    KitFailure,
    Shared,
    all_cases,
    run_case,
)
from vt.testing.matrix import CaseResult, SupportMatrix, matrix_from_results, run_matrix
from vt.testing.tolerances import WEIGHT_TYPES

ROOT = Path(__file__).resolve().parents[1]
FAULTS = Path(__file__).parent / "kit_faults" / "vt_kit_faults.py"
DOC = ROOT / "docs" / "support-matrix.md"

N_CASES = len(all_cases()) + 1  # every case plus the per-backend `executed` test
N_MODELS = len(SUPPORTED_ARCHITECTURES) * len(WEIGHT_TYPES)
N_LOGPROBS = sum(c.unit == "logprobs" for c in all_cases())  # not declared on tt_stub
N_PREFETCH = sum(c.unit == "prefetch" for c in all_cases())  # declared by neither
TT_UNDECLARED = [
    "pinned-host-memory",
    "event-ordering",
    "stream-wait-event",
    "async-d2h-readback",
    "async-readback",
    "vmm-arena",
    "graph-replay",
]


def run_kit(
    where: Path, *args: str, pythonpath: Path | None = None, conftest: str | None = None
) -> tuple[int, str, dict[str, int]]:
    """``pytest -q ARGS`` in a fresh directory; (exit status, output, outcome counts)."""
    where.mkdir()
    (where / "pytest.ini").write_text("[pytest]\n")  # not vt's own pyproject settings
    if conftest is not None:
        (where / "conftest.py").write_text(conftest)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VT_")}
    env["OPENBLAS_NUM_THREADS"] = "1"  # the machine is shared: no BLAS thread pools
    if pythonpath is not None:  # in front of any PYTHONPATH this session runs with
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs", *args],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    last = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", last)}
    return proc.returncode, out, counts


def summary(name: str, ops: int, core: int, contracts: int, models: int, failed: int) -> str:
    return (
        f"vt conformance [{name}]: {ops} ops, {core} core methods, {contracts} contracts, "
        f"{models} models passed ({failed} failed)"
    )


def failure_lines(out: str, backend: str) -> list[str]:
    """The one-line failure messages the kit printed for ``backend``."""
    prefix = f"vt conformance [{backend}]: "
    lines = [ln[len(prefix) :] for ln in out.splitlines() if ln.startswith(prefix)]
    return [ln for ln in lines if not re.match(r"\d+ ops, ", ln)]  # not the summary


def sections(markdown: str) -> str:
    """A matrix document without its first paragraph (which names the generating command)."""
    return markdown[markdown.index("\n## ") :]


# --------------------------------------------------------------------------- our backends


def test_kit_passes_on_cpu_and_tt_stub_with_counts(tmp_path: Path) -> None:
    matrix = tmp_path / "matrix.md"
    rc, out, counts = run_kit(
        tmp_path / "run", "--vt-backend", "cpu", "--vt-backend", "tt_stub", f"--vt-matrix={matrix}"
    )
    assert rc == 0, out
    assert len(OPS) == 23 and len(CORE_METHODS) == 2 and N_MODELS == 27 and len(CONTRACTS) == 11
    assert summary("cpu", 22, 2, 11, 27, 0) in out
    assert summary("tt_stub", 21, 2, 4, 27, 0) in out
    # tt_stub declares nothing: those contracts are "not declared", never passes; it lacks
    # the optional op logprobs (the runner computes them on the host), also "not declared";
    # neither declares the optional hint prefetch (the graph launches none there)
    undeclared = ["op logprobs", "op prefetch", *(f"contract {c}" for c in TT_UNDECLARED)]
    assert "  not declared: " + ", ".join(undeclared) in out
    assert "  not declared: op prefetch" in out  # cpu's
    skipped = len(TT_UNDECLARED) + N_LOGPROBS + 2 * N_PREFETCH
    assert counts == {"passed": 2 * N_CASES - skipped, "skipped": skipped}
    for cid in TT_UNDECLARED:
        assert f"vt conformance [tt_stub] contract {cid}: not declared:" in out
    # tt_stub implements only the primitive ops: its fused cases pass through the
    # decomposition, and say so; cpu runs them natively, but for matmul_add_rms_norm (a
    # GPU fusion), whose cases run decomposed there too: passes, never "not declared"
    text = matrix.read_text()
    cpu, tt = text[: text.index("\n## tt_stub")], text[text.index("\n## tt_stub") :]
    fused = ("matmul_add", "swiglu", "rope_kv_store", "qkv_rope_kv_store",
             "rms_norm_qkv_rope_kv_store", "rms_norm_swiglu")  # fmt: skip
    for op in fused:
        assert f"| `{op}` | decomposed |" in tt and f"| `{op}` | native |" in cpu
    # its 11 cases (one a weight type, Q8_0 at 5 rows, F32 out apart from residual) all pass
    assert sum(c.unit == "matmul_add_rms_norm" for c in all_cases()) == len(WEIGHT_TYPES) + 2
    per_type = " | pass (2) | pass | pass | pass (2) | pass | pass | pass | pass | pass |"
    for section in (cpu, tt):
        assert f"| `matmul_add_rms_norm` | decomposed{per_type}" in section

    # docs/support-matrix.md holds exactly what the kit finds today
    assert sections(text) == sections(DOC.read_text())


def test_the_plugin_adds_nothing_without_the_option(tmp_path: Path, request) -> None:
    eps = importlib.metadata.entry_points(group="pytest11")
    assert any(ep.value == "vt.testing.pytest_plugin" for ep in eps)
    # this very session: the plugin is loaded, yet added no plugin object and no test
    assert request.config.getoption("vt_backend") == []
    assert request.config.pluginmanager.get_plugin("vt-conformance-kit") is None
    assert not any(item.nodeid.startswith("vt-conformance") for item in request.session.items)
    work = tmp_path / "plain"
    work.mkdir()
    (work / "test_one.py").write_text("def test_one():\n    assert True\n")
    rc, out, counts = run_kit(work / "sub", str(work / "test_one.py"))
    assert rc == 0 and counts == {"passed": 1}, out
    assert "vt conformance" not in out


def test_help_documents_the_options(tmp_path: Path) -> None:
    _, out, _ = run_kit(tmp_path / "help", "--help")
    assert "--vt-backend=NAME" in out and "--vt-matrix=PATH" in out


def test_matrix_without_a_backend_is_a_usage_error(tmp_path: Path) -> None:
    rc, out, _ = run_kit(tmp_path / "run", "--vt-matrix=m.md")
    assert rc == 4 and "--vt-matrix needs --vt-backend NAME" in out
    assert not (tmp_path / "run" / "m.md").exists()


def test_unavailable_or_unknown_backend_fails_every_test_at_setup(
    tmp_path: Path, install_dist
) -> None:
    site = install_dist("vt-misc", {"misc": "vt_test_misc"})
    rc, out, counts = run_kit(tmp_path / "run", "--vt-backend", "absent,nosuch", pythonpath=site)
    assert rc == 1
    assert counts == {"errors": 2 * N_CASES}, out  # not one skipped, not one passed
    absent = "backend 'absent' is unavailable: no absent device found (driver not loaded)"
    # whatever else is installed here (vt-cuda in CI) is listed too
    installed = ", ".join(sorted(e.name for e in Registry(env={}).entries()))
    assert "absent" in installed and "cpu" in installed
    unknown = f"unknown backend 'nosuch'; installed backends: {installed}"
    # one error section per test; whole lines, because pytest under CI=true also repeats
    # each message untruncated in its short summary
    lines = out.splitlines()
    assert lines.count(f"vt conformance [absent]: {absent}") == N_CASES
    assert lines.count(f"vt conformance [nosuch]: {unknown}") == N_CASES
    assert f"  not started: {absent}" in out and f"  not started: {unknown}" in out
    assert "During handling" not in out  # the reason alone, no exception chain


def test_honest_backends_without_ops_pass_contracts_and_declare_no_op(
    tmp_path: Path, install_dist
) -> None:
    site = install_dist("vt-test-backends", {"threads_plugin": "vt_test_backends"})
    rc, out, counts = run_kit(tmp_path / "run", "--vt-backend", "threads,discrete", pythonpath=site)
    assert rc == 1
    # no op is declared: every op case is skipped "not declared", never passed or failed;
    # upload_weight has no op to read a weight back with; copy_d2d and every model fail
    assert summary("threads", 0, 0, len(CONTRACTS), 0, 1 + N_MODELS) in out  # declares all
    assert summary("discrete", 0, 0, 4, 0, 1 + N_MODELS) in out  # declares nothing
    undeclared = ", ".join(f"op {op}" for op in OPS) + ", core upload_weight"
    assert f"  not declared: {undeclared}\n" in out
    n_op_cases = sum(c.category == "op" or c.unit == "upload_weight" for c in all_cases())
    assert counts["skipped"] == 2 * n_op_cases + len(TT_UNDECLARED), out
    assert (
        "vt conformance [threads] op matmul[Q4_K,n=1,37x256]: not declared: backend 'threads' "
        "does not support op matmul for Q4_K weights (supports('matmul', 'Q4_K') is False)"
    ) in out
    assert (
        "vt conformance [threads] op swiglu[F32,n=1,37x67]: not declared: backend 'threads' "
        "does not support the fused op swiglu for F32 weights, and its decomposition needs the "
        "op(s) matmul, silu_mul, which it does not support either"
    ) in out
    threads = failure_lines(out, "threads")
    assert (
        "core copy_d2d[1001-bytes,offsets]: KernelNotImplementedError: backend 'threads' "
        "does not implement copy_d2d"
    ) in threads
    assert (
        "model qwen2-Q4_K: KernelNotImplementedError: backend 'threads' does not implement the "
        "op(s) add, attention, embedding, gather_rows, kv_store, matmul, rms_norm, rope, "
        "sample, silu_mul that a qwen2 model needs (see `vt backends --json` for its ops)"
    ) in threads
    assert "_pytest" not in out  # the traceback starts at the kit, not in pytest


# --------------------------------------------------------------------------- nothing executed


def test_a_run_that_executes_nothing_fails(tmp_path: Path) -> None:
    rc, out, counts = run_kit(tmp_path / "run", "--vt-backend", "tt_stub", "-k", "executed")
    assert rc == 1 and counts == {"failed": 1, "deselected": N_CASES - 1}, out
    assert (
        "vt conformance [tt_stub]: no kit test executed for the backend (all deselected or "
        "skipped); a run that proves nothing fails"
    ) in out
    assert summary("tt_stub", 0, 0, 0, 0, 1) in out


def test_zero_ops_collected_fails(tmp_path: Path) -> None:
    conftest = (
        "import vt.testing.kit as kit\n"
        "_all = kit.all_cases\n"
        "kit.all_cases = lambda: [c for c in _all() if c.category != 'op']\n"
    )
    rc, out, counts = run_kit(
        tmp_path / "run", "--vt-backend", "tt_stub", "-k", "executed", conftest=conftest
    )
    assert rc == 1 and counts["failed"] == 1, out
    assert "vt conformance [tt_stub]: zero ops collected for the backend" in out


def test_an_op_without_cases_fails_by_name(tmp_path: Path) -> None:
    conftest = "import vt.testing.kernels_suite as ks\nks.op_cases = lambda: []\n"
    rc, out, counts = run_kit(
        tmp_path / "run", "--vt-backend", "tt_stub", "-k", "ops or core", conftest=conftest
    )
    assert rc == 1 and counts["failed"] == len(OPS) + len(CORE_METHODS), out
    for op in OPS:
        assert (
            f"op {op}: vt.OPS lists it but the conformance kit has no case for it, so nothing "
            "would prove it"
        ) in out
    for method in CORE_METHODS:
        assert f"core {method}: vt.testing.kit.CORE_METHODS lists it but" in out


def test_a_case_that_checks_nothing_fails() -> None:
    shared = Shared()
    ctx = KitContext.start("tt_stub", shared, Registry(env={}))
    try:
        idle = KitCase("op", "add", "idle", "F32", lambda ctx: "looked fine")
        with pytest.raises(KitFailure, match=r"op add\[idle\]: executed no check"):
            run_case(idle, ctx)
    finally:
        ctx.close()
        shared.close()


# --------------------------------------------------------------------------- planted faults


def test_kit_names_each_planted_fault(tmp_path: Path, install_dist) -> None:
    site = install_dist("vt-kit-faults", {"kit_faults": "vt_kit_faults"}, {"vt_kit_faults": FAULTS})
    names = "offbyone-norm,offbyone-attention,noop-events,alias-pinned,oob-add"
    rc, out, _ = run_kit(
        tmp_path / "run", "--vt-backend", names, "-k", "not models", pythonpath=site
    )
    assert rc == 1
    # cpu's subclasses: every op but the prefetch hint, which none of them declares
    ops, core, contracts = len(OPS) - 1, len(CORE_METHODS), len(CONTRACTS)

    # an off-by-one rms_norm: every rms_norm case fails, naming the op; of the ops that
    # normalise first (decomposed), the F32 case within rms_norm_swiglu's bound (the
    # projections' bounds hide a norm this close elsewhere); of matmul_add_rms_norm (also
    # decomposed on cpu), whose normed output is the norm's own, the float types' cases
    # and Q4_K's (the quantized bound hides the others); of the projection-and-consumer
    # ops (decomposed), the half types' cases; nothing else fails
    norm = failure_lines(out, "offbyone-norm")
    assert len(norm) == 14 and all(
        re.match(r"op rms_norm\[.*\]: normalized MSE \S+ exceeds the F32 tolerance 1e-09", m)
        for m in norm[:4]
    ), norm
    assert norm[4].startswith("op rms_norm_swiglu[F32,n=1,37x67]: normalized MSE")
    assert [m.split(": normed: normalized MSE ")[0] for m in norm[5:10]] == [
        f"op matmul_add_rms_norm[{label}]"
        for label in ("F32,n=1,37x67,in-place", "F16,n=1,37x67,in-place",
                      "BF16,n=1,37x67,in-place", "Q4_K,n=1,37x256,in-place", "F32,n=1,37x67")
    ], norm[:10]  # fmt: skip
    assert [m.split(": normalized MSE ")[0] for m in norm[10:]] == [
        f"op matmul_add_rms_norm_{op}[{wt},n=1,{label}]: {what}"
        for op, label, what in (("swiglu", "37x67", "act"), ("qkv_rope_kv_store", "neox", "q"))
        for wt in ("F16", "BF16")
    ], norm[10:]
    assert summary("offbyone-norm", ops - 5, core, contracts, 0, 5) in out
    assert (
        "  failed: op rms_norm, op rms_norm_swiglu, op matmul_add_rms_norm, "
        "op matmul_add_rms_norm_swiglu, op matmul_add_rms_norm_qkv_rope_kv_store\n"
    ) in out

    # attention that drops its last position: all but the position-0 case fail, and every
    # case of attention_bounded, which the backend runs as attention
    attn = failure_lines(out, "offbyone-attention")
    assert sorted(m.split(":")[0] for m in attn) == sorted(
        [
            *(
                f"op attention[{label}]"
                for label in ("n=1,last-pos", "n=7,3-slots,prefill+decode", "n=2,no-gqa",
                              "n=3,gqa-4,hd=64")
            ),
            *(
                f"op attention_bounded[{label}]"
                for label in ("n=1,tight", "n=1,room", "n=1,max-len",
                              "n=7,3-slots,prefill+decode", "n=3,gqa-4,hd=64")
            ),
        ]
    )  # fmt: skip
    assert summary("offbyone-attention", ops - 2, core, contracts, 0, 2) in out

    # no-op events while declaring them: every contract that relies on events fails
    events = failure_lines(out, "noop-events")
    assert (
        "contract event-ordering failed: event-ordering: work recorded before the event had "
        "not finished after synchronize_event returned"
    ) in events
    assert any(
        re.match(r"contract staging-reuse failed: step \d's device input holds", m) for m in events
    ), events
    assert any(
        m.startswith("contract async-d2h-readback failed: after the ready event") for m in events
    )
    assert summary("noop-events", ops, core, contracts - 5, 0, 5) in out
    assert (
        "  failed: contract event-ordering, contract stream-wait-event, contract "
        "async-d2h-readback, contract async-readback, contract staging-reuse"
    ) in out

    # pinned memory that is a device allocation, handed out again by alloc
    assert failure_lines(out, "alias-pinned") == [
        "contract pinned-host-memory failed: writing the device allocation made later changed "
        "the pinned buffer (first changed byte 0): alloc_pinned returned memory that is (or "
        "aliases) a device allocation"
    ]
    assert summary("alias-pinned", ops, core, contracts - 1, 0, 1) in out

    # add writing one float past its output: the guard region after it catches every case
    assert failure_lines(out, "oob-add") == [
        f"op add[{label}]: wrote 4 byte(s) past the end of {role} (the nearest is byte 1 "
        "past it): an out-of-bounds write"
        for label, role in (("1x1", "output 'out'"), ("7x143", "output 'out'"),
                            ("7x143,in-place", "inout 'a'"))
    ]  # fmt: skip
    assert summary("oob-add", ops - 1, core, contracts, 0, 1) in out


# --------------------------------------------------------------------------- vt audit --matrix


def test_vt_audit_matrix_json_matches_the_published_matrix() -> None:
    result = CliRunner().invoke(main, ["audit", "--matrix", "--backend", "tt_stub", "--json"])
    assert result.exit_code == 0, result.output
    matrix = SupportMatrix.model_validate_json(result.output)
    assert matrix.ok and matrix.command == "vt audit --matrix --backend tt_stub"
    (tt,) = matrix.backends
    assert tt.tested and tt.capabilities["events"] is False
    assert tt.ops == {
        op: "decomposed" if OPS[op].fused else "fallback" if OPS[op].optional else "native"
        for op in OPS
    }
    by_unit = {(r.category, r.unit, r.label): r for r in tt.results}
    assert len(by_unit) == N_CASES - 1
    assert by_unit[("contract", "event-ordering", "")].result == "not declared"
    assert by_unit[("model", "qwen3-Q4_K", "")].result == "pass"
    published = sections(DOC.read_text())
    tt_section = published[published.index("\n## tt_stub") :]
    assert sections(matrix.render(markdown=True)) == tt_section


def test_vt_audit_matrix_markdown_and_failure_exit(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["audit", "--matrix", "--backend", "nosuch"])
    assert result.exit_code == 1
    assert result.output.startswith("# Support matrix\n")
    assert "Generated by `vt audit --matrix --backend nosuch`" in result.output
    assert "## nosuch\n\nNot tested: unknown backend 'nosuch'" in result.output


def test_matrix_of_every_installed_backend_lists_unavailable_with_reason(install_dist) -> None:
    install_dist("vt-misc", {"misc": "vt_test_misc"})
    matrix = run_matrix(None, Registry(env={"VT_PLUGINS": "misc"}))
    reasons = {b.name: (b.tested, b.reason) for b in matrix.backends}
    assert reasons["absent"] == (
        False,
        "backend 'absent' is unavailable: no absent device found (driver not loaded)",
    )
    assert (
        reasons["flaky"][0] is False and "OSError: device node /dev/flaky0" in reasons["flaky"][1]
    )
    assert not matrix.ok  # nothing was tested, and flaky is broken
    doc = json.loads(matrix.render(markdown=False))
    assert [b["name"] for b in doc["backends"]] == ["absent", "flaky"]


def test_matrix_marks_failed_cells_and_lists_failures() -> None:
    cases = {c.id: c for c in all_cases()}
    results = [
        CaseResult.of("mine", c, "pass", "ok")
        for c in cases.values()
        if c.category != "contract" or c.capability is None
    ]
    bad = cases["rms_norm[n=24,dim=16,eps=1e-06]"]
    results = [r for r in results if r.label != bad.label or r.unit != bad.unit]
    results.append(CaseResult.of("mine", bad, "fail", "op rms_norm[n=24,dim=16,eps=1e-06]: X"))
    undeclared = [c for c in cases.values() if c.category == "contract" and c.capability]
    results += [CaseResult.of("mine", c, "not declared", "") for c in undeclared]
    caps = {"events": False, "vmm": None, "device_memory_is_host_addressable": False}
    matrix = matrix_from_results(["mine", "gone"], results, "test", {"mine": caps}, {"gone": "why"})
    assert not matrix.ok
    text = matrix.render(markdown=True)
    assert summary("mine", 22, 2, 4, 27, 1) in text
    assert "| `rms_norm` | - | **FAIL** (1/4) |" in text  # how it runs: not recorded here
    assert "| `events` | no | `event-ordering` | not declared |" in text
    assert "| `device_memory_is_host_addressable` | no | `host-view` (must refuse) | pass |" in text
    assert "### Failures\n\n- op rms_norm[n=24,dim=16,eps=1e-06]: X\n" in text
    assert text.endswith("## gone\n\nNot tested: why\n")
