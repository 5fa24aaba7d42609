"""Device memory policies: the VMM arena and the KV cache (``contiguous`` | ``vmm``).

See ``docs/memory.md`` for the growth policy and the segment-aliasing story.
"""

from __future__ import annotations

from .arena import TENSOR_ALIGNMENT, ArenaTensor, VmmArena, arena_tensor, vmm_granularity
from .kv import (
    DEFAULT_GROW_TOKENS,
    DEFAULT_MIN_GROWTH_BYTES,
    KV_KINDS,
    KVCache,
    KVCacheStats,
    KVCapacityError,
    resolve_kind,
)

__all__ = [
    "DEFAULT_GROW_TOKENS",
    "DEFAULT_MIN_GROWTH_BYTES",
    "KV_KINDS",
    "TENSOR_ALIGNMENT",
    "ArenaTensor",
    "KVCache",
    "KVCacheStats",
    "KVCapacityError",
    "VmmArena",
    "arena_tensor",
    "resolve_kind",
    "vmm_granularity",
]
