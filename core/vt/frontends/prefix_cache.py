"""Prefix reuse across requests: a freed KV slot remembers the tokens its KV holds.

A request that lands in a slot whose earlier tokens start the same way as its prompt (a
chat template's system prompt, the earlier turns of a conversation) skips prefilling that
common prefix: the runner keeps those positions (``ModelRunner.free_slot(slot, keep=n)``)
and the request's first chunk starts after them. This is llama-server's slot prompt cache
and vLLM's prefix caching, for a cache laid out as one row of positions per slot.

Among the free slots a new request looks for the one sharing the longest prefix with its
prompt (ties: the slot freed longest ago). If that prefix is at least half of what the
slot holds (the next turn of a conversation, or the same prompt again), the request takes
that slot and overwrites only the rest. If it is less (another conversation that shares the
chat template's system prompt), taking the slot would destroy the longer history it holds,
as llama-server's ``--slot-prompt-similarity 0.5`` also reasons: the runner copies the
shared prefix (``ModelRunner.copy_prefix``) into the free slot freed longest ago (an empty
one first) and the request takes that one, so both histories stay until slots run out.

Numerics: the reused positions hold exactly the KV the earlier request computed for the
same tokens at the same positions. The request's own steps have fewer rows than a full
prefill would, and a backend may pick its kernel by the rows of a step (8-bit activations
for a few rows, float BLAS for many), so its logits can differ within the conformance
tolerances and a greedy near-tie can resolve differently than without the cache, as with
llama.cpp's prompt cache. ``prefix_caching=False`` (``vt serve --no-prefix-caching``)
prefills every prompt whole.
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["PrefixCache", "common_prefix"]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading entries ``a`` and ``b`` share."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    """What each free slot's KV holds, and which free slot a prompt should take."""

    def __init__(self, n_slots: int) -> None:
        self._tokens: list[np.ndarray | None] = [None] * n_slots
        self._freed_at = [0] * n_slots
        self._clock = itertools.count(1)

    def remember(self, slot: int, tokens: list[int]) -> None:
        """``slot``'s positions ``0..len(tokens)-1`` hold the KV of ``tokens``."""
        self._tokens[slot] = np.asarray(tokens, dtype=np.int64) if tokens else None
        self._freed_at[slot] = next(self._clock)

    def held(self, slot: int) -> int:
        """Positions of ``slot`` that hold reusable KV."""
        t = self._tokens[slot]
        return 0 if t is None else int(t.shape[0])

    def forget(self, slot: int) -> None:
        self._tokens[slot] = None

    def clear(self) -> None:
        self._tokens = [None] * len(self._tokens)

    def copy_target(self, best: int, shared: int, others: list[int]) -> int | None:
        """Where to copy ``best``'s first ``shared`` positions instead of reusing ``best``
        in place: the slot of ``others`` freed longest ago (an empty one first), when
        ``shared`` is less than half of what ``best`` holds; else None."""
        if not shared or not others or 2 * shared >= self.held(best):
            return None
        return min(others, key=lambda s: (self._tokens[s] is not None, self._freed_at[s]))

    def pick(self, free_slots: list[int], prompt: list[int]) -> tuple[int, int]:
        """``(slot, reused)``: the free slot for ``prompt`` and how many of its first
        positions the request can skip. At least the prompt's last token is always left to
        compute, since its row gives the first sampled token's logits."""
        ids = np.asarray(prompt, dtype=np.int64)
        best, best_key = free_slots[0], (-1, 0)
        for slot in free_slots:
            held = self._tokens[slot]
            shared = 0 if held is None else common_prefix(held, ids)
            key = (shared, -self._freed_at[slot])
            if key > best_key:
                best, best_key = slot, key
        return best, min(best_key[0], len(prompt) - 1)
