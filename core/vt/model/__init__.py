"""GGUF models: file loading, config, tokenizer, chat template and the model cache.

The llama-family graph (``vt.model.graph``) lives beside these and is the runner's.
"""

from __future__ import annotations

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
from .chat import (
    ChatTemplate,
    ChatTemplateError,
    RenderLimits,
    TemplateRenderer,
    validate_messages,
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
