"""vt.gpu.kernel_cache: compiled kernels kept in VT_HOME/kernels across processes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from vt.gpu import Binaries, GpuCallError, load_or_build, read_or_build
from vt.gpu.kernel_cache import cache_path

IDENTITY = ("nvrtc", "13.0", "--gpu-architecture=sm_90", "-DVT_WARP=32", "abc123")


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VT_HOME", str(tmp_path / "vt-home"))
    return tmp_path / "vt-home"


class Driver:
    """Builds and loads binaries, counting both; refuses the binaries in ``bad``."""

    def __init__(self, binary: bytes = b"CUBIN") -> None:
        self.binary, self.builds, self.loads = binary, 0, []
        self.bad: set[bytes] = set()

    def build(self) -> bytes:
        self.builds += 1
        return self.binary

    def load(self, binary: bytes) -> str:
        self.loads.append(binary)
        if binary in self.bad:
            raise GpuCallError("cuModuleLoadData(...)", 200, "CUDA_ERROR_INVALID_IMAGE", "bad")
        return f"module of {binary!r}"


def run(driver: Driver, identity: tuple[str, ...] = IDENTITY) -> tuple[str, bytes]:
    return load_or_build("cuda", identity, driver.build, driver.load)


def test_the_first_call_builds_and_keeps_the_next_loads(_home: Path) -> None:
    first = Driver()
    assert run(first) == ("module of b'CUBIN'", b"CUBIN") and first.builds == 1
    path = cache_path("cuda", IDENTITY)
    assert path is not None and path.parent == _home / "kernels"
    assert path.name.startswith("cuda-") and path.read_bytes() == b"CUBIN"
    later = Driver(b"OTHER")
    assert run(later) == ("module of b'CUBIN'", b"CUBIN") and later.builds == 0
    assert run(later, (*IDENTITY[:-1], "def456"))[1] == b"OTHER"  # another source: built
    assert later.builds == 1


def test_a_refused_cached_binary_is_built_again_and_replaced() -> None:
    run(Driver(b"DAMAGED"))
    driver = Driver(b"GOOD")
    driver.bad.add(b"DAMAGED")
    assert run(driver) == ("module of b'GOOD'", b"GOOD")
    assert driver.loads == [b"DAMAGED", b"GOOD"] and driver.builds == 1
    path = cache_path("cuda", IDENTITY)
    assert path is not None and path.read_bytes() == b"GOOD"


def test_a_built_binary_the_driver_refuses_raises_and_is_not_kept() -> None:
    driver = Driver(b"BAD")
    driver.bad.add(b"BAD")
    with pytest.raises(GpuCallError, match="CUDA_ERROR_INVALID_IMAGE"):
        run(driver)
    path = cache_path("cuda", IDENTITY)
    assert path is not None and not path.exists()


def test_off_with_vt_kernel_cache_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VT_KERNEL_CACHE", "0")
    assert cache_path("cuda", IDENTITY) is None
    driver = Driver()
    run(driver)
    run(driver)
    assert driver.builds == 2


def test_an_unwritable_home_builds_every_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "home").write_text("a file where the directory would go")
    monkeypatch.setenv("VT_HOME", str(tmp_path / "home"))
    driver = Driver()
    assert run(driver)[1] == b"CUBIN" and run(driver)[1] == b"CUBIN"
    assert driver.builds == 2
    assert list(tmp_path.iterdir()) == [tmp_path / "home"]  # no temporary file left


def test_a_build_says_so_on_stderr_a_cached_load_does_not(
    _home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A machine's first run compiles for tens of seconds: the user is told why, and where
    the result is kept; the runs after it load the binary quietly."""
    driver = Driver()
    load_or_build("cuda", IDENTITY, driver.build, driver.load, announce="vt_kernels.cu")
    first, ready = capsys.readouterr().err.splitlines()
    assert first == (
        f"vt: compiling cuda kernels vt_kernels.cu (first run only; kept in {_home / 'kernels'})..."
    )
    assert ready.startswith("vt: cuda kernels vt_kernels.cu ready in ") and ready.endswith(" s")
    load_or_build("cuda", IDENTITY, driver.build, driver.load, announce="vt_kernels.cu")
    assert capsys.readouterr().err == "" and driver.builds == 1
    run(Driver(), (*IDENTITY[:-1], "other"))  # no name to announce: quiet
    assert capsys.readouterr().err == ""


def test_a_build_with_the_cache_off_says_every_run_compiles(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VT_KERNEL_CACHE", "0")
    driver = Driver()
    load_or_build("hip", IDENTITY, driver.build, driver.load, announce="vt_kernels.cu")
    assert capsys.readouterr().err.splitlines()[0] == (
        "vt: compiling hip kernels vt_kernels.cu (VT_KERNEL_CACHE=0: every run)..."
    )


def test_a_build_that_could_not_be_kept_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "home").write_text("a file where the directory would go")
    monkeypatch.setenv("VT_HOME", str(tmp_path / "home"))
    driver = Driver()
    load_or_build("cuda", IDENTITY, driver.build, driver.load, announce="vt_kernels.cu")
    ready = capsys.readouterr().err.splitlines()[1]
    assert ready.endswith(f" s (not kept: {tmp_path / 'home' / 'kernels'} could not be written)")


def test_read_or_build_builds_once_keeps_it_and_loads_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An adapter's prebuild (any thread, no driver call): the binary as load_or_build
    would find or build it, announced the same way, never loaded."""
    driver = Driver()
    assert read_or_build("cuda", IDENTITY, driver.build, announce="vt_kernels.cu") == b"CUBIN"
    assert driver.builds == 1 and driver.loads == []
    assert capsys.readouterr().err.startswith("vt: compiling cuda kernels vt_kernels.cu (")
    path = cache_path("cuda", IDENTITY)
    assert path is not None and path.read_bytes() == b"CUBIN"
    assert read_or_build("cuda", IDENTITY, Driver(b"OTHER").build) == b"CUBIN"  # read
    assert capsys.readouterr().err == ""
    assert run(driver) == ("module of b'CUBIN'", b"CUBIN") and driver.builds == 1


def test_read_or_build_with_the_cache_off_builds_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VT_KERNEL_CACHE", "0")
    driver = Driver()
    read_or_build("hip", IDENTITY, driver.build)
    read_or_build("hip", IDENTITY, driver.build)
    assert driver.builds == 2


def test_a_prebuilt_binary_is_loaded_first_and_a_refused_one_built_again() -> None:
    """``prebuilt`` (an adapter's read_or_build, unchecked) loads without a build or a
    read; one the driver refuses falls back to the cache, then to a build that replaces it."""
    driver = Driver(b"GOOD")
    module, binary = load_or_build("cuda", IDENTITY, driver.build, driver.load, prebuilt=b"PRE")
    assert (module, binary) == ("module of b'PRE'", b"PRE") and driver.builds == 0
    read_or_build("cuda", IDENTITY, Driver(b"DAMAGED").build)  # a damaged file kept
    driver.bad |= {b"DAMAGED"}
    module, binary = load_or_build("cuda", IDENTITY, driver.build, driver.load, prebuilt=b"DAMAGED")
    assert binary == b"GOOD" and driver.builds == 1
    assert driver.loads == [b"PRE", b"DAMAGED", b"DAMAGED", b"GOOD"]
    path = cache_path("cuda", IDENTITY)
    assert path is not None and path.read_bytes() == b"GOOD"


def test_a_process_binaries_load_again_without_a_build_and_take_a_prebuild_once() -> None:
    """Binaries (an adapter's compile and prebuild): the options reach the build with the
    architecture's first and make the disk identity with the compiler's name and version;
    a second load of a key builds nothing, nor reads the disk; a prebuild is built once and
    taken by the next load; clear() forgets both, as a new process would."""
    built: list[tuple[str, ...]] = []
    loads: list[bytes] = []

    def build(options: Sequence[str]) -> bytes:
        built.append(tuple(options))
        return b"BIN" + str(len(built)).encode()

    binaries = Binaries("cuda")
    key = Binaries.key("sm_90", "--gpu-architecture=sm_90", "src", ["-DVT_WARP=32"])
    assert key[:2] == ("sm_90", ("--gpu-architecture=sm_90", "-DVT_WARP=32"))
    compiler = lambda: ("nvrtc", "13.0")  # noqa: E731
    load = lambda binary: loads.append(binary) or binary.decode()  # noqa: E731
    assert binaries.load(key, compiler, build, load) == "BIN1"
    assert binaries.load(key, compiler, build, load) == "BIN1" and len(built) == 1
    path = cache_path("cuda", ("nvrtc", "13.0", *key[1], key[2]))
    assert path is not None and path.read_bytes() == b"BIN1"
    other = Binaries.key("sm_90", "--gpu-architecture=sm_90", "another source", [])
    binaries.prebuild(other, compiler, build)
    binaries.prebuild(other, compiler, build)  # once
    assert built == [key[1], other[1]] and loads == [b"BIN1", b"BIN1"]
    assert binaries.load(other, compiler, build, load) == "BIN2" and len(built) == 2
    binaries.clear()
    assert binaries.built == binaries.prebuilt == {}
