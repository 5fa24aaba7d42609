"""GGUF loading: valid tiny models of every architecture and tensor type, and every kind of
broken file refused with a ModelError that says what is wrong (never a crash or a hang)."""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from pydantic import ValidationError
from vt import ModelError, RopeStyle, WeightTensor
from vt.model import gguf_file as gguf_file_mod
from vt.model import load_gguf, resolve_model, scan_gguf
from vt.testing.tiny import quantize_matrix, write_tiny_gguf

K_DIMS = {"dim": 256, "ffn": 256}
TYPES = {
    "F32": {},
    "F16": {},
    "BF16": {},
    "Q8_0": {},
    "Q4_0": {},
    "Q4_1": {},
    "Q4_K": K_DIMS,
    "Q5_K": K_DIMS,
    "Q6_K": K_DIMS,
}


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def _copy_truncated(src: Path, dst: Path, n: int) -> Path:
    dst.write_bytes(src.read_bytes()[:n])
    return dst


def _patch(path: Path, offset: int, fmt: str, value: int) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------- valid files


def test_tiny_llama_config(tiny: Path) -> None:
    mf = load_gguf(tiny)
    c = mf.config
    assert (c.architecture, c.n_layers, c.dim, c.ffn_dim) == ("llama", 2, 64, 128)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (4, 2, 16, 300)
    assert c.context_length == 256
    assert c.rms_eps == pytest.approx(1e-5)
    assert c.rope.style is RopeStyle.normal and c.rope.base == 10000.0
    assert c.rope.linear_factor == 1.0 and c.rope.inv_freq is None
    assert c.tied_output and not c.has_qkv_bias and not c.has_qk_norm
    with pytest.raises(ValidationError):  # frozen
        c.dim = 3  # type: ignore[misc]


def test_tensor_is_raw_bytes_in_logical_shape(tiny: Path) -> None:
    mf = load_gguf(tiny)
    t = mf.tensor("blk.0.ffn_down.weight")
    assert isinstance(t, WeightTensor)
    assert t.shape == (64, 128)  # (out_features, in_features): GGUF ne reversed
    assert t.ggml_type == GGMLQuantizationType.Q8_0
    assert t.data.dtype == np.uint8 and t.data.ndim == 1
    assert t.data.nbytes == 64 * 128 // 32 * 34
    assert not t.data.flags.writeable  # a view of the read-only mmap, not a copy
    assert t.data.base is not None
    # Same bytes the real gguf reader sees.
    ref = next(r for r in GGUFReader(tiny).tensors if r.name == t.name)
    assert bytes(t.data) == ref.data.tobytes()
    assert mf.dequantize(t.name).shape == (64, 128)


def test_layer_tensors_and_output(tiny: Path, tmp_path: Path) -> None:
    mf = load_gguf(tiny)
    lt = mf.layer_tensors(1)
    names = {t.name for _, t in lt.items()}
    assert names == {
        f"blk.1.{s}.weight"
        for s in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm")
        + ("ffn_gate", "ffn_up", "ffn_down")
    }
    assert lt.attn_k.shape == (32, 64) and lt.attn_q_bias is None and lt.attn_q_norm is None
    assert mf.output().name == "token_embd.weight"  # tied
    assert mf.output_norm().shape == (64,)
    with pytest.raises(ModelError, match="layer 2 is out of range"):
        mf.layer_tensors(2)
    with pytest.raises(ModelError, match="no tensor 'nope'"):
        mf.tensor("nope")
    kept = mf.tensor("output_norm.weight")
    with mf:
        pass
    with pytest.raises(ModelError, match="closed"):
        mf.tensor("output_norm.weight")
    assert kept.data.shape == (256,)  # tensors handed out stay valid

    untied = load_gguf(write_tiny_gguf(tmp_path / "untied.gguf", tied=False))
    assert not untied.config.tied_output
    assert untied.output().name == "output.weight"
    assert untied.output().shape == (300, 64)


def test_qwen2_biases_and_qwen3_qk_norm(tmp_path: Path) -> None:
    q2 = load_gguf(write_tiny_gguf(tmp_path / "q2.gguf", arch="qwen2"))
    assert q2.config.has_qkv_bias and not q2.config.has_qk_norm
    assert q2.config.rope.style is RopeStyle.neox
    lt = q2.layer_tensors(0)
    assert lt.attn_q_bias.shape == (64,) and lt.attn_v_bias.shape == (32,)

    q3 = load_gguf(write_tiny_gguf(tmp_path / "q3.gguf", arch="qwen3", head_dim=32))
    c = q3.config
    assert c.has_qk_norm and not c.has_qkv_bias and c.rope.style is RopeStyle.neox
    assert c.head_dim == 32 and c.q_dim == 128  # key_length, not dim // n_heads
    assert q3.layer_tensors(1).attn_k_norm.shape == (32,)
    assert q3.layer_tensors(0).attn_q.shape == (128, 64)


@pytest.mark.parametrize("weight_type", list(TYPES))
def test_every_supported_tensor_type_loads(tmp_path: Path, weight_type: str) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", weight_type=weight_type, **TYPES[weight_type])
    mf = load_gguf(path)
    t = mf.tensor("blk.0.attn_q.weight")
    assert GGMLQuantizationType(t.ggml_type).name == weight_type
    assert weight_type in mf.type_histogram()
    w = mf.dequantize("blk.0.attn_q.weight")
    assert w.shape == t.shape and np.isfinite(w).all() and np.abs(w).max() > 0


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_writer_round_trips(qtype: str) -> None:
    # The tiny writer's own K-quant encoders, checked by gguf's decoder.
    x = np.random.default_rng(3).standard_normal((3, 512)).astype(np.float32)
    back = dequantize(quantize_matrix(x, qtype), GGMLQuantizationType[qtype]).reshape(x.shape)
    rms = float(np.sqrt(np.mean((back - x) ** 2)))
    assert rms < {"Q4_K": 0.12, "Q5_K": 0.06, "Q6_K": 0.03}[qtype]


def test_rope_scaling_from_metadata(tmp_path: Path) -> None:
    linear = load_gguf(
        write_tiny_gguf(
            tmp_path / "lin.gguf",
            metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
        )
    )
    assert linear.config.rope.linear_factor == 4.0

    llama3 = load_gguf(
        write_tiny_gguf(
            tmp_path / "l3.gguf",
            rope_base=500000.0,
            metadata={"llama.rope.scaling.type": "llama3", "llama.rope.scaling.factor": 8.0},
        )
    ).config.rope
    assert llama3.inv_freq is not None and len(llama3.inv_freq) == 8
    plain = 500000.0 ** (-np.arange(0, 16, 2) / 16)
    assert llama3.inv_freq[0] == pytest.approx(plain[0])  # high frequencies unchanged
    assert llama3.inv_freq[-1] == pytest.approx(plain[-1] / 8.0)  # low ones divided

    factors = np.linspace(1.0, 8.0, 8).astype(np.float32)
    stored = load_gguf(
        write_tiny_gguf(tmp_path / "rf.gguf", extra_tensors={"rope_freqs.weight": factors})
    ).config.rope
    expected = 10000.0 ** (-np.arange(0, 16, 2) / 16) / factors
    np.testing.assert_allclose(stored.inv_freq, expected, rtol=1e-6)

    with pytest.raises(ModelError, match="rope.scaling.type 'yarn' is not supported"):
        load_gguf(
            write_tiny_gguf(tmp_path / "y.gguf", metadata={"llama.rope.scaling.type": "yarn"})
        )


@pytest.mark.slow
def test_default_model_matches_model_facts() -> None:
    mf = load_gguf(resolve_model("default", progress=False))
    c = mf.config
    assert c.architecture == "llama"
    assert (c.n_layers, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads, c.head_dim) == (
        30,
        576,
        1536,
        9,
        3,
        64,
    )
    assert (c.vocab_size, c.context_length) == (49152, 8192)
    assert c.rope.base == 100000.0 and c.rope.style is RopeStyle.normal
    assert c.rms_eps == pytest.approx(1e-5)
    assert c.tied_output and not mf.has_tensor("output.weight")
    assert mf.type_histogram() == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert mf.token_embedding().ggml_type == GGMLQuantizationType.Q8_0
    assert mf.layer_tensors(29).ffn_down.shape == (576, 1536)


# --------------------------------------------------------------------------- broken files


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no such model file"):
        load_gguf(tmp_path / "absent.gguf")
    with pytest.raises(ModelError, match="not a regular file"):
        load_gguf(tmp_path)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"NOPE" + b"\0" * 64, r"magic bytes are b'NOPE'"),
        (b"PK\x03\x04" + b"\0" * 64, r"b'PK\\x03\\x04'.*zip or wheel"),
        (b"", "0 bytes"),
        (b"GG", "too short"),
    ],
)
def test_bad_magic_and_tiny_files(tmp_path: Path, content: bytes, expected: str) -> None:
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(ModelError, match=expected):
        load_gguf(p)


@pytest.mark.parametrize("version", [1, 4, 99])
def test_unsupported_version(tiny: Path, version: int) -> None:
    _patch(tiny, 4, "<I", version)
    with pytest.raises(ModelError, match=f"unsupported GGUF version {version}"):
        load_gguf(tiny)


def _section_offsets(path: Path) -> dict[str, int]:
    reader = GGUFReader(path)
    return {
        "header": 12,
        "first key": 30,
        "token array": reader.fields["tokenizer.ggml.tokens"].offset + 200,
        "last key": reader.fields["tokenizer.chat_template"].offset + 40,
        "tensor info": reader.tensors[3].field.offset + 5,
        "data start": reader.data_offset - 1,
        "first tensor data": reader.tensors[0].data_offset + 10,
        "last byte": path.stat().st_size - 1,
    }


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "where",
    [
        "header",
        "first key",
        "token array",
        "last key",
        "tensor info",
        "data start",
        "first tensor data",
        "last byte",
    ],
)
def test_truncated_files(tiny: Path, tmp_path: Path, where: str) -> None:
    cut = _section_offsets(tiny)[where]
    short = _copy_truncated(tiny, tmp_path / "short.gguf", cut)
    with pytest.raises(ModelError, match="truncated") as err:
        load_gguf(short)
    assert str(short) in str(err.value)


def test_tensor_offset_past_end_of_file(tiny: Path) -> None:
    reader = GGUFReader(tiny)
    victim = reader.tensors[-1]
    del reader
    name = victim.name.encode()
    # name length (8) + name + n_dims (4) + dims (8 each) + type (4), then the offset.
    at = victim.field.offset + 8 + len(name) + 4 + 8 * len(victim.shape) + 4
    _patch(tiny, at, "<Q", 1 << 30)
    with pytest.raises(ModelError, match=f"tensor '{victim.name}'.*file has only"):
        load_gguf(tiny)


def test_misaligned_tensor_offset(tiny: Path) -> None:
    reader = GGUFReader(tiny)
    victim = reader.tensors[1]
    at = victim.field.offset + 8 + len(victim.name) + 4 + 8 * len(victim.shape) + 4
    rel = victim.data_offset - reader.data_offset
    del reader
    _patch(tiny, at, "<Q", rel + 3)
    with pytest.raises(ModelError, match="not a multiple of the alignment"):
        load_gguf(tiny)


def test_bogus_array_length_fails_fast(tiny: Path) -> None:
    reader = GGUFReader(tiny)
    field = reader.fields["tokenizer.ggml.token_type"]
    key_len = len("tokenizer.ggml.token_type")
    # key length (8) + key + value type (4) + item type (4), then the array length.
    at = field.offset + 8 + key_len + 4 + 4
    del reader
    _patch(tiny, at, "<Q", 1 << 60)
    with pytest.raises(
        ModelError, match="tokenizer.ggml.token_type.*truncated|truncated.*token_type"
    ):
        load_gguf(tiny)


def test_huge_counts_in_header(tiny: Path) -> None:
    _patch(tiny, 16, "<Q", 1 << 50)  # kv count
    with pytest.raises(ModelError, match="cannot fit"):
        load_gguf(tiny)


def test_unknown_tensor_type_id(tiny: Path) -> None:
    reader = GGUFReader(tiny)
    victim = reader.tensors[0]
    at = victim.field.offset + 8 + len(victim.name) + 4 + 8 * len(victim.shape)
    del reader
    _patch(tiny, at, "<I", 99)
    with pytest.raises(ModelError, match=f"tensor '{victim.name}' has an unknown GGML type id 99"):
        load_gguf(tiny)


@pytest.mark.parametrize("weight_type", ["Q5_0", "Q5_1"])
def test_unsupported_tensor_type_names_tensor_and_type(tmp_path: Path, weight_type: str) -> None:
    path = write_tiny_gguf(tmp_path / "q5.gguf", weight_type=weight_type)
    with pytest.raises(ModelError) as err:
        load_gguf(path)
    msg = str(err.value)
    assert "blk.0.attn_q.weight" in msg and weight_type in msg and "Q4_K" in msg


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "neox.gguf", metadata={"general.architecture": "gptneox"})
    with pytest.raises(
        ModelError, match=r"unsupported architecture 'gptneox'.*llama, qwen2, qwen3"
    ):
        load_gguf(path)


@pytest.mark.parametrize(
    "key",
    [
        "general.architecture",
        "llama.block_count",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.context_length",
        "llama.attention.layer_norm_rms_epsilon",
    ],
)
def test_missing_required_metadata_names_the_key(tmp_path: Path, key: str) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", metadata={key: None})
    with pytest.raises(ModelError, match=f"'{key}' is missing"):
        load_gguf(path)


def test_bad_metadata_values(tmp_path: Path) -> None:
    p = write_tiny_gguf(tmp_path / "a.gguf", metadata={"llama.block_count": "two"})
    with pytest.raises(ModelError, match="'llama.block_count' must be an integer"):
        load_gguf(p)
    p = write_tiny_gguf(tmp_path / "b.gguf", metadata={"llama.attention.head_count_kv": 3})
    with pytest.raises(ModelError, match="not a multiple of head_count_kv"):
        load_gguf(p)
    p = write_tiny_gguf(tmp_path / "c.gguf", metadata={"llama.vocab_size": 301})
    with pytest.raises(ModelError, match="vocab_size \\(301\\) disagrees"):
        load_gguf(p)


def test_corrupt_counts_fail_fast(tmp_path: Path) -> None:
    p = write_tiny_gguf(tmp_path / "a.gguf", metadata={"llama.block_count": 1_900_000})
    with pytest.raises(ModelError, match="block_count is 1900000, but the file holds only"):
        load_gguf(p)
    p = write_tiny_gguf(tmp_path / "b.gguf", metadata={"llama.attention.key_length": 1 << 30})
    with pytest.raises(ModelError, match="head dimension 1073741824 is not supported"):
        load_gguf(p)


def test_missing_tensor_and_wrong_shape(tmp_path: Path) -> None:
    p = write_tiny_gguf(tmp_path / "a.gguf", omit_tensors=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelError, match="tensor 'blk.1.ffn_up.weight' is missing"):
        load_gguf(p)
    p = write_tiny_gguf(tmp_path / "b.gguf", metadata={"llama.feed_forward_length": 64})
    with pytest.raises(
        ModelError, match=r"'blk.0.ffn_gate.weight' has shape \(128, 64\), expected \(64, 64\)"
    ):
        load_gguf(p)


def test_mapping_errors_are_wrapped(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_map(path: Path) -> None:
        raise OSError("Cannot allocate memory")

    monkeypatch.setattr(gguf_file_mod, "_map_file", broken_map)
    with pytest.raises(ModelError, match="cannot map the file: OSError") as err:
        load_gguf(tiny)
    assert str(tiny) in str(err.value)


def test_metadata_equals_the_gguf_readers(tmp_path: Path) -> None:
    """vt reads the metadata itself; every value equals what gguf.GGUFReader reads."""
    path = write_tiny_gguf(
        tmp_path / "m.gguf",
        metadata={"x.flag": True, "x.floats": [0.5, 1.25], "x.text": "héllo"},
    )
    mine = load_gguf(path).metadata
    theirs = {
        name: (value.item() if isinstance(value := f.contents(), np.generic) else value)
        for name, f in GGUFReader(path).fields.items()
        if not name.startswith("GGUF.")
    }
    assert mine == theirs
    assert mine["x.flag"] is True and mine["x.floats"] == [0.5, 1.25]


@pytest.mark.timeout(60)
def test_random_corruption_gives_model_error_or_a_model(tiny: Path, tmp_path: Path) -> None:
    """Flip bytes in the header and metadata: every outcome is a ModelError or a valid load."""
    import random

    from vt.model import ChatTemplate, Tokenizer

    src = tiny.read_bytes()
    header_end = GGUFReader(tiny).data_offset
    rng = random.Random(1234)
    target = tmp_path / "fuzz.gguf"
    outcomes = {"ok": 0, "error": 0}
    for _ in range(200):
        data = bytearray(src)
        for _ in range(rng.choice([1, 2, 4])):
            data[rng.randrange(header_end)] = rng.randrange(256)
        target.write_bytes(bytes(data))
        try:
            mf = load_gguf(target)
            Tokenizer.from_model(mf)
            ChatTemplate.from_model(mf)
            outcomes["ok"] += 1
        except ModelError:
            outcomes["error"] += 1
    assert outcomes["error"] > 50 and outcomes["ok"] > 10


# --------------------------------------------------------------------------- issue 11, items 5-6


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def _raw_gguf(path: Path, kvs: list[bytes], size: int | None = None) -> Path:
    """A GGUF of these key/values and no tensors; ``size`` extends it with a hole (a
    sparse file: the declared lengths fit without writing the bytes)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs))
    with open(path, "wb") as f:
        f.write(head + b"".join(kvs))
        if size is not None:
            f.truncate(size)
    return path


def _array_head(item_type: int, count: int) -> bytes:
    return struct.pack("<IQ", item_type, count)


ARRAY, U8, STRING = 9, 0, 8


@pytest.mark.timeout(20)
def test_a_big_metadata_array_is_read_fast(tmp_path: Path) -> None:
    # The issue's 2.1 MB file with a 2M-item u8 array took gguf.GGUFReader 96 s and 1.4 GB.
    items = bytes(range(256)) * (2_000_000 // 256)
    path = _raw_gguf(
        tmp_path / "big.gguf", [_kv("x.big", ARRAY, _array_head(U8, len(items)) + items)]
    )
    t0 = time.monotonic()
    layout = scan_gguf(path)
    assert time.monotonic() - t0 < 1
    assert layout.metadata["x.big"][:3] == [0, 1, 2] and len(layout.metadata["x.big"]) == len(items)
    with pytest.raises(ModelError, match="'general.architecture' is missing"):
        load_gguf(path)  # whole-file checks come after, as for any file


@pytest.mark.timeout(20)
def test_a_million_key_values_are_refused_at_once(tmp_path: Path) -> None:
    # 1M small key/values took the reader 228 s and 3.2 GB.
    kvs = [_kv(f"k{i}", U8, b"\0") for i in range(1_000_000)]
    path = _raw_gguf(tmp_path / "keys.gguf", kvs)
    t0 = time.monotonic()
    with pytest.raises(ModelError, match="claims 1000000 metadata keys; vt reads at most 65536"):
        load_gguf(path)
    assert time.monotonic() - t0 < 1


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("kvs", "size", "message"),
    [
        # A 200M-item array was killed at 3.6 GB.
        ([_kv("x.a", ARRAY, _array_head(U8, 200_000_000))], 210 << 20,
         "'x.a' is an array of 200000000 items; vt reads at most"),
        ([_kv("x.s", STRING, struct.pack("<Q", 300 << 20))], 310 << 20,
         "more than 268435456 bytes of strings"),
        ([_kv(f"x.{i}", ARRAY, _array_head(U8, 6 << 20) + bytes(6 << 20)) for i in range(3)],
         None, "more than 16777216 array items"),
        ([_kv("x.n", ARRAY, _array_head(ARRAY, 1) + _array_head(ARRAY, 1)
              + _array_head(ARRAY, 1) + _array_head(ARRAY, 1))], None, "nests arrays too deeply"),
    ],
)  # fmt: skip
def test_metadata_past_the_bounds_is_refused_before_it_is_read(
    tmp_path: Path, kvs: list[bytes], size: int | None, message: str
) -> None:
    path = _raw_gguf(tmp_path / "m.gguf", kvs, size)
    t0 = time.monotonic()
    with pytest.raises(ModelError, match=message) as err:
        load_gguf(path)
    assert time.monotonic() - t0 < 3
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def _tensor_field(path: Path, index: int) -> tuple[int, int]:
    """(offset of the tensor info's type field, of its offset field)."""
    t = GGUFReader(path).tensors[index]
    at = t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape)
    return at, at + 4


def _relative_offset(path: Path, index: int) -> int:
    reader = GGUFReader(path)
    return reader.tensors[index].data_offset - reader.data_offset


@pytest.mark.parametrize(
    ("victim", "new_offset", "message"),
    [
        (1, lambda p: _relative_offset(p, 0), r"'blk.0.attn_norm.weight' .* overlaps it"),
        (2, lambda p: _relative_offset(p, 1), r"'blk.0.attn_q.weight' .* overlaps it"),
        (2, lambda p: _relative_offset(p, 2) + 64, r"'blk.0.attn_q.weight' .* leaves 64 bytes"),
    ],
)
def test_overlapping_or_shared_tensor_offsets_are_refused(
    tiny: Path, victim: int, new_offset: Any, message: str
) -> None:
    _, offset_at = _tensor_field(tiny, victim)
    _patch(tiny, offset_at, "<Q", new_offset(tiny))
    with pytest.raises(ModelError, match=message) as err:
        load_gguf(tiny)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("victim", "new_type", "message"),
    [
        (2, GGMLQuantizationType.Q4_0, r"'blk.0.attn_k.weight' .* leaves 2048 bytes"),
        (2, GGMLQuantizationType.F32, r"'blk.0.attn_k.weight' .* overlaps it"),
        (-1, GGMLQuantizationType.F16, r"bytes after its last tensor 'output_norm.weight'"),
    ],
)
def test_a_tensor_type_that_does_not_match_its_data_is_refused(
    tiny: Path, victim: int, new_type: int, message: str
) -> None:
    type_at, _ = _tensor_field(tiny, victim)
    _patch(tiny, type_at, "<I", int(new_type))
    with pytest.raises(ModelError, match=message):
        load_gguf(tiny)


BAD_METADATA = [
    ({"llama.rope.freq_base": float("inf")}, "'llama.rope.freq_base' must be a finite number"),
    ({"llama.rope.freq_base": 1e-30}, "llama.rope.freq_base must be between 1 and 1e+12"),
    ({"llama.rope.freq_base": float("nan")}, "must be a finite number, got nan"),
    ({"llama.rope.scaling.factor": float("nan")}, "must be a finite number"),
    ({"llama.attention.layer_norm_rms_epsilon": float("inf")}, "must be a finite number"),
    ({"general.architecture": ["llama"]}, "'general.architecture' must be a string"),
]
BAD_TOKENIZER = [
    ({"tokenizer.ggml.add_bos_token": "false"}, "'tokenizer.ggml.add_bos_token' must be a boolean"),
    ({"tokenizer.ggml.add_eos_token": 1}, "'tokenizer.ggml.add_eos_token' must be a boolean"),
    ({"tokenizer.ggml.pre": ["llama-bpe"]}, "'tokenizer.ggml.pre' must be a string"),
    ({"tokenizer.ggml.token_type": ["1"] * 300}, "'tokenizer.ggml.token_type' must be an integer"),
]


@pytest.mark.parametrize(("metadata", "message"), BAD_METADATA + BAD_TOKENIZER)
def test_inconsistent_metadata_is_refused_in_one_line(
    tmp_path: Path, metadata: dict[str, Any], message: str
) -> None:
    from vt.model import Tokenizer

    path = write_tiny_gguf(tmp_path / "m.gguf", metadata=metadata)
    with pytest.raises(ModelError) as err:
        Tokenizer.from_model(load_gguf(path))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [BAD_METADATA[0], BAD_METADATA[1], BAD_TOKENIZER[0], BAD_TOKENIZER[2]],
)
def test_vt_run_refuses_inconsistent_files_in_one_line(
    tmp_path: Path, metadata: dict[str, Any], message: str
) -> None:
    from click.testing import CliRunner
    from vt.frontends.cli import main

    path = write_tiny_gguf(tmp_path / "m.gguf", metadata=metadata)
    result = CliRunner().invoke(main, ["run", "--model", str(path), "--backend", "cpu", "Hi"])
    assert result.exit_code == 1
    # One error line (a backend may also say it compiles its kernels on first use).
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in result.output


def test_vt_run_refuses_overlapping_tensors_in_one_line(tiny: Path) -> None:
    from click.testing import CliRunner
    from vt.frontends.cli import main

    _, offset_at = _tensor_field(tiny, 1)
    _patch(tiny, offset_at, "<Q", _relative_offset(tiny, 0))
    result = CliRunner().invoke(main, ["run", "--model", str(tiny), "--backend", "cpu", "Hi"])
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: {tiny}: tensor 'blk.0.attn_norm")


# --------------------------------------------------------------------------- string arrays


def test_string_arrays_are_held_compactly_and_read_like_lists(tmp_path: Path) -> None:
    from vt.model.string_array import StringArray

    texts = ["héllo", "", "Ġthe", "<|im_end|>", "日本"]
    path = _raw_gguf(
        tmp_path / "s.gguf",
        [
            _kv(
                "x.s",
                ARRAY,
                _array_head(STRING, len(texts))
                + b"".join(struct.pack("<Q", len(t.encode())) + t.encode() for t in texts),
            )
        ],
    )
    value = scan_gguf(path).metadata["x.s"]
    assert isinstance(value, StringArray)
    assert value == texts and texts == value and value != texts[:-1]
    assert value == StringArray.of(texts) and value != ["x"] * len(texts)
    assert len(value) == 5 and list(value) == texts and value[0] == "héllo"
    assert value[-1] == "日本" and value[np.int64(2)] == "Ġthe" and value[1:3] == ["", "Ġthe"]
    assert value.index("<|im_end|>") == 3 and "日本" in value and "x" not in value
    with pytest.raises(IndexError):
        value[5]
    with pytest.raises(TypeError):
        value["a"]
    with pytest.raises(TypeError):
        hash(value)
    assert repr(value) == "StringArray(['héllo', '', 'Ġthe', ...], 5 strings)"


def test_a_vocabulary_costs_what_the_file_stores() -> None:
    from vt.model.string_array import StringArray

    tokens = [f"tok{i}" for i in range(100_000)]
    array = StringArray.of(tokens)
    assert array.nbytes == sum(map(len, tokens)) + 4 * (len(tokens) + 1)  # ~1 MB, not ~6


def test_a_bad_string_in_an_array_names_its_index(tmp_path: Path) -> None:
    items = struct.pack("<Q", 2) + b"ok" + struct.pack("<Q", 2) + b"\xff\xfe"
    path = _raw_gguf(tmp_path / "s.gguf", [_kv("x.s", ARRAY, _array_head(STRING, 2) + items)])
    with pytest.raises(ModelError, match=r"key/value 'x.s'\[1\] is not valid UTF-8"):
        scan_gguf(path)
