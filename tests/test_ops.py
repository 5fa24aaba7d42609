"""The op table: its structure, how a backend's ops are planned, and where users see them."""

from __future__ import annotations

import json

import pytest
import vt
from click.testing import CliRunner
from model_support import make_backend
from vt.frontends.cli import main
from vt.model.graph import ARCHITECTURE_OPS
from vt.protocol.ops import OPS, closure, get_op, missing_ops, op_plan, plan_text


def test_every_op_has_a_reference_and_fused_ops_decompose_into_table_ops() -> None:
    for name, op in OPS.items():
        assert op.name == name and op.doc and callable(op.reference)
        assert len({a.name for a in op.args}) == len(op.args), name
        if op.fused:
            # parts of the table; a fused part (qkv_rope_kv_store's) expands in turn, ending
            # in primitive ops
            assert op.parts and all(p in OPS and p != name for p in op.parts), name
            assert not closure([name], set(vt.PRIMITIVE_OPS).__contains__)[1], name
            # a decomposition writes only into what the caller passed: scratch, not new memory
            assert any(a.kind in ("out", "inout") for a in op.args)
        else:
            assert not op.parts
    assert set(vt.PRIMITIVE_OPS) | set(vt.FUSED_OPS) | set(vt.OPTIONAL_OPS) == set(OPS)
    assert vt.OPTIONAL_OPS == ("logprobs", "prefetch")
    assert all(OPS[op].fallback for op in vt.OPTIONAL_OPS)
    # the hint changes nothing: its reference writes no tensor (it has none to write)
    assert not any(a.is_tensor for a in OPS["prefetch"].args)


def test_an_optional_op_is_a_fallback_never_missing() -> None:
    plan = op_plan(set(vt.PRIMITIVE_OPS).__contains__)
    assert plan["logprobs"] == "fallback" and "missing" not in plan.values()
    assert plan_text(plan).endswith("fallback: logprobs, prefetch")
    assert op_plan(set(OPS).__contains__)["logprobs"] == "native"


def test_each_architecture_declares_ops_of_the_table() -> None:
    for arch, ops in ARCHITECTURE_OPS.items():
        assert ops and set(ops) <= set(OPS), arch


def test_unknown_op_names_the_table() -> None:
    with pytest.raises(KeyError, match="unknown op 'matmull'.*matmul"):
        get_op("matmull")


def test_plan_native_decomposed_and_missing() -> None:
    primitives = set(vt.PRIMITIVE_OPS)
    plan = op_plan(primitives.__contains__)
    assert {n for n, k in plan.items() if k == "decomposed"} == set(vt.FUSED_OPS)
    no_rope = op_plan((primitives - {"rope"}).__contains__)
    assert no_rope["rope"] == "missing" and no_rope["rope_kv_store"] == "missing"
    assert no_rope["swiglu"] == "decomposed"
    assert plan_text(no_rope).startswith("native: embedding")
    assert "missing: rope, rope_kv_store" in plan_text(no_rope)
    lacking = plan_text(op_plan(lambda _op: False))
    assert lacking.startswith("fallback: logprobs, prefetch; missing: embed")


def test_closure_expands_only_what_the_backend_lacks() -> None:
    native, missing = closure(["swiglu"], {"swiglu"}.__contains__)
    assert native == {"swiglu"} and not missing
    native, missing = closure(["swiglu"], {"matmul"}.__contains__)
    assert native == {"matmul"} and missing == {"silu_mul"}
    assert missing_ops(ARCHITECTURE_OPS["llama"], set(vt.PRIMITIVE_OPS).__contains__) == []


def test_vt_backends_and_audit_show_each_backends_ops() -> None:
    runner = CliRunner()
    table = runner.invoke(main, ["backends"])
    assert table.exit_code == 0, table.output
    assert "ops: native: embedding" in table.output
    assert "decomposed: matmul_add, swiglu, rope_kv_store" in table.output  # tt_stub
    assert "fallback: logprobs" in table.output  # tt_stub: the host computes logprobs
    listed = {e["name"]: e for e in json.loads(runner.invoke(main, ["backends", "--json"]).output)}
    # cpu runs every op natively but the GPU's projection-and-norm fusions,
    # attention_bounded (no context classes: the graph never launches it there) and the
    # prefetch hint (the graph launches none there)
    gpu_fusions = ("matmul_add_rms_norm", "matmul_add_rms_norm_swiglu",
                   "matmul_add_rms_norm_qkv_rope_kv_store", "attention_bounded")  # fmt: skip
    cpu_native = [op for op in OPS if op not in (*gpu_fusions, "prefetch")]
    assert listed["cpu"]["ops"] == cpu_native and listed["tt_stub"]["ops"] == list(vt.PRIMITIVE_OPS)
    audit = runner.invoke(main, ["audit", "--backend", "tt_stub", "--json"])
    assert audit.exit_code == 0, audit.output
    (report,) = json.loads(audit.output)["backends"]
    assert report["ops"]["swiglu"] == "decomposed" and report["ops"]["matmul"] == "native"
    text = runner.invoke(main, ["audit", "--backend", "cpu"]).output
    assert "  ops    native: embedding" in text
    line = text.split("\n")[1]
    assert line.endswith("; decomposed: " + ", ".join(gpu_fusions) + "; fallback: prefetch")


def test_attention_bounded_refuses_a_bound_outside_the_cache_and_a_row_past_it() -> None:
    """The bound is checked at launch on every backend (1..max_len); the reference, which
    reads the positions, refuses a row at or past it."""
    import numpy as np
    from vt.protocol.ops import get_op

    layout = vt.KVLayout(n_layers=1, n_slots=2, max_len=4, n_kv_heads=1, head_dim=4)
    backend = make_backend("tt_stub")
    stream = backend.create_stream()
    bufs = {n: backend.alloc(4 * k) for n, k in (("o", 4), ("q", 4), ("c", 64), ("s", 1), ("p", 1))}
    for buf in bufs.values():
        backend.copy_h2d(buf, np.zeros(buf.nbytes, np.uint8))  # slot 0, position 0
    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    args = {
        "out": vt.Tensor.of(bufs["o"], f32, 1, 4), "q": vt.Tensor.of(bufs["q"], f32, 1, 4),
        "cache": vt.Tensor.of(bufs["c"], f32, *layout.shape),
        "slots": vt.Tensor.of(bufs["s"], i32, 1), "positions": vt.Tensor.of(bufs["p"], i32, 1),
        "layout": layout, "layer": 0, "n_heads": 1, "scale": 0.5,
    }  # fmt: skip
    for bad in (0, -1, 5):
        with pytest.raises(
            ValueError, match=rf"attention_bounded: context {bad} is out of range \[1, 4\]"
        ):
            backend.launch("attention_bounded", stream, **args, context=bad)
    for bad in (2.0, True, "3"):
        with pytest.raises(ValueError, match=r"attention_bounded: context must be an int"):
            backend.launch("attention_bounded", stream, **args, context=bad)
    backend.launch("attention_bounded", stream, **args, context=4)  # in range: runs
    backend.synchronize(stream)
    q = np.ones((1, 4), np.float32)
    ref = {"out": np.zeros_like(q), "q": q, "cache": np.zeros(layout.shape, np.float32),
           "slots": np.zeros(1, np.int32), "positions": np.array([2], np.int32),
           "layout": layout, "layer": 0, "n_heads": 1, "scale": 0.5}  # fmt: skip
    with pytest.raises(ValueError, match="position 2 is past the context bound 2"):
        get_op("attention_bounded").reference({**ref, "context": 2})
    get_op("attention_bounded").reference({**ref, "context": 3})
    for buf in bufs.values():
        backend.free(buf)


def test_launch_asks_supports_with_the_weight_type() -> None:
    """A backend that runs matmul only for F32 weights is refused, naming the type, when a
    step asks it for another."""
    import numpy as np
    from vt.testing.kernels_suite import weight_tensor
    from vt_tt_stub.backend import TtStubBackend

    class F32Only(TtStubBackend):
        name = "f32-only"

        def supports(self, op: str, dtype: str | None = None) -> bool:
            if op == "matmul" and dtype not in (None, "F32"):
                return False
            return super().supports(op, dtype)

    b = F32Only()
    s = b.create_stream("s")
    x = vt.Tensor(b.alloc(2 * 32 * 4), np.float32, (2, 32))
    out = vt.Tensor(b.alloc(2 * 8 * 4), np.float32, (2, 8))
    f32 = b.upload_weight(weight_tensor("w", np.ones((8, 32), np.float32), "F32")[0])
    q8 = b.upload_weight(weight_tensor("w", np.ones((8, 32), np.float32), "Q8_0")[0])
    b.launch("matmul", s, out=out, x=x, weight=f32)
    with pytest.raises(vt.KernelNotImplementedError, match="'matmul' for Q8_0 weights"):
        b.launch("matmul", s, out=out, x=x, weight=q8)
