"""GGUF models: file loading, config, tokenizer, chat template and the model cache.

The llama-family graph (``vt.model.graph``) lives beside these and is the runner's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .cache import (
    DEFAULT_MODEL,
    CachedModel,
    KnownModel,
    list_models,
    models_dir,
    pull,
    resolve_model,
    vt_home,
)
from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .gguf_file import (
    SUPPORTED_TENSOR_TYPES,
    LayerTensors,
    ModelFile,
    TensorInfo,
    load_gguf,
    scan_gguf,
)
from .tokenizer import IncrementalDecoder, Tokenizer

if TYPE_CHECKING:
    from .chat import (
        ChatTemplate,
        ChatTemplateError,
        RenderLimits,
        TemplateRenderer,
        validate_messages,
    )

# Chat templates need jinja2 (~1.6 MiB resident beside vt's other imports, 15 ms to import):
# loaded when first asked for, so a process that never renders a chat (vt bench, the
# runner) never imports it.
_CHAT_NAMES = frozenset(
    ("ChatTemplate", "ChatTemplateError", "RenderLimits", "TemplateRenderer", "validate_messages")
)


def __getattr__(name: str) -> Any:
    if name in _CHAT_NAMES:
        from . import chat

        return getattr(chat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_MODEL",
    "CachedModel",
    "KnownModel",
    "list_models",
    "models_dir",
    "pull",
    "resolve_model",
    "vt_home",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDecoder",
    "LayerTensors",
    "ModelConfig",
    "ModelFile",
    "RenderLimits",
    "TemplateRenderer",
    "TensorInfo",
    "Tokenizer",
    "load_gguf",
    "scan_gguf",
    "validate_messages",
]
