"""``vt_cpu.native``: the cpu backend's C functions mapped by vt from the object code numba
saved for them, so a warm process never builds numba's target (issue 10's memory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from model_support import tiny_path
from numba import cfunc
from vt_cpu import native
from vt_cpu.kernels import jobs as J
from vt_cpu.kernels.team import entries

# (a platform's fact, not a setting: VT_CPU_NATIVE is cleared for each test)
pytestmark = pytest.mark.skipif(not native.platform_ok(), reason="maps x86-64 ELF on Linux only")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(native, "_images", {})
    return tmp_path


def _numba_job(name: str) -> object:
    """Job ``name`` as numba compiles (or loads) it, saved to the cache."""
    kw = J._EXACT if name in ("rope_kv", "silu_mul") else J._KW
    compiled = cfunc(J.SIGNATURE, **kw)(J._JOBS[name])
    native.save(name, compiled)
    return compiled


def _run(addr: int, args: np.ndarray, units: int) -> None:
    entries().run_alone(addr, args.ctypes.data, units)


def test_a_mapped_job_gives_the_bits_of_numbas(cache: Path) -> None:
    compiled = _numba_job("rms_norm")
    mapped = native.load("rms_norm")
    assert mapped is not None and mapped != compiled.address
    assert native.loaded() == ["rms_norm"]
    rng = np.random.default_rng(0)
    n, dim = 5, 576
    x = rng.standard_normal((n, dim), dtype=np.float32)
    w = rng.standard_normal(dim, dtype=np.float32)
    eps = np.array([1e-5], np.float32)
    outs = []
    for addr in (compiled.address, mapped):
        out = np.zeros((n, dim), np.float32)
        args = np.array([x.ctypes.data, n, dim, w.ctypes.data, eps.ctypes.data, out.ctypes.data])
        _run(addr, args.astype(np.int64), n)
        outs.append(out)
    assert outs[0].any() and np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_the_mapped_dequantizer_gives_the_references_rows(cache: Path, kind: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from vt.testing.tiny import quantize_matrix

    _numba_job("dq")
    mapped = native.load("dq")
    assert mapped is not None
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 512)).astype(np.float32)
    raw = np.ascontiguousarray(quantize_matrix(w, kind)).view(np.uint8)
    raw = raw.reshape(6 * 512 // 256 if kind[-1] == "K" else 6 * 512 // 32, -1)
    rows = np.array([5, 0, 3], np.int64)
    out = np.zeros((3, 512), np.float32)
    args = np.array(
        [J.DQ_FORMAT[kind], raw.ctypes.data, raw.shape[0], raw.shape[1], kind == "Q4_1",
         rows.ctypes.data, out.ctypes.data, 512],
        np.int64,
    )  # fmt: skip
    _run(mapped, args, 3)
    ref = dequantize(quantize_matrix(w, kind), GGMLQuantizationType[kind]).reshape(6, 512)
    assert np.array_equal(out, ref[rows])


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "not ours", "other symbol"])
def test_a_damaged_saved_object_is_never_mapped(cache: Path, damage: str) -> None:
    _numba_job("silu_mul")
    path = native._path("silu_mul")
    raw = path.read_bytes()
    if damage == "flipped byte":  # the code changed: its sha256 no longer matches
        i = len(raw) - 100
        raw = raw[:i] + bytes([raw[i] ^ 0xFF]) + raw[i + 1 :]
    elif damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "not ours":
        raw = os.urandom(len(raw))
    else:
        raw = raw.replace(b"cfunc.", b"cfunX.", 1)  # names a symbol the object lacks
    path.write_bytes(raw)
    assert native.load("silu_mul") is None
    assert native.loaded() == []


def test_an_object_vt_cannot_map_raises_a_clear_error() -> None:
    with pytest.raises(native.NativeError, match="not an x86-64 little-endian"):
        native.Image(b"\x7fELF" + bytes(60))
    with pytest.raises(native.NativeError, match="not an object vt can map"):
        native.Image(b"\x7fELF\x02\x01")
    header = bytearray(64)  # a valid ELF header with no sections at all: no symbol table
    header[:6] = b"\x7fELF\x02\x01"
    header[16:20] = (1).to_bytes(2, "little") + (62).to_bytes(2, "little")
    with pytest.raises(native.NativeError, match="StopIteration"):
        native.Image(bytes(header))


def test_a_saved_object_of_other_kernels_is_not_loaded(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _numba_job("gather")
    monkeypatch.setattr(native, "_key", "another-source-or-cpu")
    assert native.load("gather") is None


def test_vt_cpu_native_0_neither_maps_nor_saves(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VT_CPU_NATIVE", "0")
    _numba_job("multi")
    assert list(cache.iterdir()) == [] and native.load("multi") is None


# Three requests: every step has 3 rows (or a prompt's), which Q4_K runs as C jobs; a
# step of exactly 2 rows takes numba's Q4_K row kernels, which build numba's target.
_GENERATE = """
import json, sys
import vt
from vt_cpu import native
with vt.LLM(model=sys.argv[1], backend="cpu", verify=False) as llm:
    out = llm.generate(["The sky is"] * 3, vt.SamplingParams(max_tokens=12, temperature=0))
print(json.dumps({
    "ids": [o.ids for o in out],
    "numba_target": "numba.np.arraymath" in sys.modules,
    "mapped": native.loaded(),
}))
"""


def _generate(model: Path, native_on: bool) -> dict:
    import json

    env = {**os.environ, "VT_CPU_NATIVE": "1" if native_on else "0"}
    done = subprocess.run(
        [sys.executable, "-c", _GENERATE, str(model)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_warm_process_runs_without_numbas_target_and_generates_the_same_ids(
    tiny_dir: Path,
) -> None:
    model = tiny_path(tiny_dir, "llama", "Q4_K", dim=256, ffn=256, n_heads=4)
    _generate(model, True)  # compiles or maps, and saves what it compiled
    warm = _generate(model, True)
    assert not warm["numba_target"]
    assert {"team.run_program", "team.helper_loop", "rms_norm", "dq"} <= set(warm["mapped"])
    numba_only = _generate(model, False)
    assert numba_only["numba_target"] and numba_only["mapped"] == []
    assert warm["ids"] == numba_only["ids"] and len(warm["ids"][0]) == 12


def test_saved_objects_go_where_numbas_cache_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numba

    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))  # NUMBA_CACHE_DIR
    assert native.cache_dir() == tmp_path / "vt-native"


def test_a_job_vt_saves_is_compiled_anew_not_taken_from_numbas_cache(cache: Path) -> None:
    # numba's cache knows a job by jobs.py alone: after a change to a kernel it inlines
    # it would hand back the old code, which vt would then save under the new key.
    from numba.core.caching import NullCache

    J._numba_job("silu_mul")
    compiled = J._numba_jobs["silu_mul"]
    assert isinstance(compiled._cache, NullCache) and compiled.cache_hits == 0
    assert native.load("silu_mul") is not None  # and saved, under the key of every source
