"""vt.gpu's weight formats: what the GPU kernels dequantize equals vt.reference bit for bit.

The kernels read ``scale * q + offset`` per value (kernels/common.cu ``vt_wload``); ``PackedWeight.
values()`` mirrors it in numpy, so these tests pin the repacking without a GPU, in the
compact layouts and the wide one.
"""

from __future__ import annotations

import numpy as np
import pytest
import vt
from gguf import GGMLQuantizationType
from vt.gpu import weights as W
from vt.gpu.backend import MAX_HEAD_DIM, rope_table
from vt.testing.kernels_suite import weight_tensor
from vt.testing.tolerances import WEIGHT_TYPES

KINDS = {"F32": W.WT_F32, "F16": W.WT_F16, "BF16": W.WT_BF16}
#: Device bytes a value of each quantized type in its compact layout (docs/gpu.md).
COMPACT_BYTES = {"Q8_0": 1.0625, "Q4_0": 0.5625, "Q4_1": 0.625, "Q4_K": 0.75}


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "wide"])
@pytest.mark.parametrize("wtype", WEIGHT_TYPES)
def test_packed_values_equal_the_reference_dequantization(wtype: str, compact: bool) -> None:
    cols = 67 if wtype in KINDS else 512 if wtype.endswith("_K") else 96
    values = (np.random.default_rng(7).standard_normal((9, cols)) * 3).astype(np.float32)
    values[0, :8] = 0.0  # zero blocks: scales of 0
    tensor, ref = weight_tensor("w", values, wtype)
    packed = W.pack(tensor, compact=compact)
    assert packed.kind == KINDS.get(wtype, W.WT_Q)
    assert (packed.rows, packed.cols) == (9, cols)
    np.testing.assert_array_equal(packed.values(), ref)
    if packed.kind == W.WT_Q:
        block = 16 if wtype == "Q6_K" else 32
        assert packed.lg_block == block.bit_length() - 1
        assert packed.scales is not None
        assert packed.layout == (W.LAYOUTS[tensor.ggml_type] if compact else 0)
        wide = 1 + 8 / block
        per_value = (packed.data.nbytes + packed.scales.nbytes) / (9 * cols)
        assert per_value == (COMPACT_BYTES.get(wtype, 1.25) if compact else wide)


@pytest.mark.parametrize(("wtype", "flags"), [("Q8_0", W.Q_ONE), ("Q4_0", W.Q_ONE), ("Q6_K", 0)])
def test_a_layout_override_keeps_the_values(wtype: str, flags: int) -> None:
    """A benchmark's layout for one type (Q8_0 with float32 scales, Q4_0 as int8 codes,
    Q6_K wide) dequantizes to the same values; the other types keep theirs."""
    cols = 512 if wtype.endswith("_K") else 96
    values = (np.random.default_rng(5).standard_normal((4, cols)) * 3).astype(np.float32)
    tensor, ref = weight_tensor("w", values, wtype)
    packed = W.pack(tensor, layouts={wtype: flags})
    assert packed.layout == flags
    np.testing.assert_array_equal(packed.values(), ref)
    other, _ = weight_tensor("o", values[:, :96], "Q4_1" if wtype == "Q6_K" else "Q8_0")
    overrides = {wtype: flags} if wtype == "Q6_K" else {"Q4_1": 0}
    assert W.pack(other, layouts=overrides).layout == W.LAYOUTS[other.ggml_type]


@pytest.mark.parametrize(
    ("wtype", "layouts", "message"),
    [
        ("Q8_0", {"Q8_1": 0}, "'Q8_1': not a quantized type vt packs"),
        ("Q8_0", {"Q8_0": 0x1000}, "flags 0x1000 are not Q_\\* flags"),
        ("Q8_0", {"Q8_0": W.Q_NIB}, "tensor 'w': layout 0x100 cannot hold Q8_0's values"),
        ("Q4_1", {"Q4_1": W.Q_ONE}, "tensor 'w': layout 0x800 cannot hold Q4_1's values"),
    ],
)
def test_a_bad_layout_override_is_refused_by_name(
    wtype: str, layouts: dict[str, int], message: str
) -> None:
    """A benchmark's override that names no type, sets other bits, or cannot hold the
    type's codes (Q8_0 in nibbles) or pairs (Q4_1's offsets dropped) is a ValueError."""
    values = (np.random.default_rng(6).standard_normal((2, 96)) * 3).astype(np.float32)
    tensor, _ = weight_tensor("w", values, wtype)
    with pytest.raises(ValueError, match=message):
        W.pack(tensor, layouts=layouts)


def test_nibbles_hold_each_chunks_values_j_and_j_plus_8() -> None:
    """The byte order the kernels' vt_unnib reads: Q4_0 codes -8..7 as nibbles 0..15."""
    values = np.tile(np.arange(-8, 8, dtype=np.float32), (2, 2))  # d = 1: codes = values
    tensor, ref = weight_tensor("w", values, "Q4_0")
    packed = W.pack(tensor)
    assert packed.layout == W.Q_NIB | W.Q_NIB8 | W.Q_HALF | W.Q_ONE
    want = [j | ((j + 8) << 4) for j in range(8)]  # nibble n = code + 8
    assert packed.data.view(np.uint8)[:16].tolist() == want * 2
    np.testing.assert_array_equal(packed.values(), ref)


def test_vectors_become_float32() -> None:
    tensor, ref = weight_tensor("norm", np.linspace(-1, 1, 96, dtype=np.float32), "F16")
    tensor.shape = (96,)
    packed = W.pack(tensor)
    assert packed.kind == W.WT_F32 and (packed.rows, packed.cols) == (1, 96)
    np.testing.assert_array_equal(packed.values()[0], ref.reshape(-1))


def _tensor(ggml_type: int, shape: tuple[int, ...], nbytes: int) -> vt.WeightTensor:
    return vt.WeightTensor("blk.0.w", ggml_type, shape, np.zeros(nbytes, np.uint8))


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (_tensor(GGMLQuantizationType.IQ2_XXS, (4, 256), 4 * 66), "IQ2_XXS is not supported"),
        (_tensor(99, (4, 32), 128), "type 99 is not supported"),
        (_tensor(GGMLQuantizationType.F32, (2, 2, 2), 32), "not a 3-d tensor"),
        (_tensor(GGMLQuantizationType.Q8_0, (4, 48), 4 * 34), "not a multiple of the Q8_0 block"),
        (_tensor(GGMLQuantizationType.Q4_1, (4, 32), 79), "needs 80 bytes, got 79"),
        (_tensor(GGMLQuantizationType.F16, (0, 8), 0), "invalid shape"),
    ],
    ids=["iq2", "unknown", "3d", "block", "bytes", "empty"],
)
def test_bad_tensors_are_refused_naming_the_tensor(tensor: vt.WeightTensor, message: str) -> None:
    with pytest.raises(vt.ModelError, match=message) as info:
        W.pack(tensor)
    assert "blk.0.w" in str(info.value)


def test_rope_table_matches_the_reference_frequencies() -> None:
    params = vt.RopeParams(64, 10000.0, linear_factor=4.0)
    table = rope_table(params)
    want = 10000.0 ** (-2.0 * np.arange(32) / 64) / 4.0
    assert list(table.inv[:32]) == want.tolist() and table.inv[32] == 0.0
    inv = tuple(float(v) for v in np.linspace(1.0, 0.01, 8))
    assert list(rope_table(vt.RopeParams(16, inv_freq=inv)).inv[:8]) == list(inv)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (vt.RopeParams(MAX_HEAD_DIM + 2), f"up to {MAX_HEAD_DIM}"),
        (vt.RopeParams(15), "positive even number"),
        (vt.RopeParams(16, linear_factor=0.0), "linear_factor must be positive"),
        (vt.RopeParams(16, inv_freq=(1.0, 0.5)), "inv_freq has 2 entries, head_dim 16 needs 8"),
    ],
)
def test_bad_rope_params_are_refused(params: vt.RopeParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rope_table(params)
