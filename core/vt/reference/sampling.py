"""Reference sampling: greedy, temperature, top-k, top-p, with a counter-based uniform.

The procedure, per row (a device kernel must follow it exactly):

1. ``temperature <= 0``: greedy, the argmax of the logits (the lowest id on ties).
2. ``l = logits / temperature`` in float32.
3. Candidates are the ids sorted by ``l`` descending, ties by ascending id (a stable sort).
   ``0 < top_k < vocab`` keeps the first ``top_k`` of them.
4. ``p = exp(l - l_max)`` over the candidates, divided by its float32 sum.
5. ``top_p < 1`` keeps the smallest prefix whose running sum ``c`` (float32, in candidate
   order) reaches ``top_p``: the first ``j + 1`` where ``c[j] >= top_p``.
6. ``u = uniform(seed, counter)``; with ``c`` the running sum of the kept ``p``, the
   result is the first kept candidate ``j`` with ``c[j] > u * c[-1]`` (never one whose
   ``p`` is 0).

Sums and ``exp`` are float32; another implementation may round differently, so its draw
can differ only where ``u * c[-1]`` lies within rounding of a boundary of ``c``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..protocol.handles import SAMPLE_PARAMS_DTYPE

_M64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


def splitmix64(x: int) -> int:
    """SplitMix64's output function of the 64-bit state ``x`` (Steele, Lea & Flood 2014)."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, counter: int) -> float:
    """A deterministic uniform in ``[0, 1)`` from two uint32s.

    ``z = splitmix64((seed << 32) | counter)`` with every operation modulo 2**64 (add
    0x9E3779B97F4A7C15; ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27;
    z *= 0x94D049BB133111EB; z ^= z >> 31``), then ``u = (z >> 40) * 2**-24``: the top
    24 bits, so ``u`` is exactly representable in float32.
    """
    if not (0 <= seed <= _U32 and 0 <= counter <= _U32):
        raise ValueError(f"uniform: seed {seed} and counter {counter} must be uint32")
    return (splitmix64((seed << 32) | counter) >> 40) * 2.0**-24


def sample(logits: np.ndarray, params: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """One int32 id per row of ``logits[n, vocab]``; ``params`` holds ``n`` records of
    :data:`vt.SAMPLE_PARAMS_DTYPE`. See the module docstring for the exact procedure."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"sample: logits must be [n, vocab] with vocab > 0, got {logits.shape}")
    params = np.asarray(params).reshape(-1)
    if params.dtype != SAMPLE_PARAMS_DTYPE:
        raise ValueError(f"sample: params must have SAMPLE_PARAMS_DTYPE, got {params.dtype}")
    n = logits.shape[0]
    if params.shape[0] != n:
        raise ValueError(f"sample: {params.shape[0]} parameter rows for {n} rows of logits")
    if out is None:
        out = np.empty(n, dtype=np.int32)
    for r in range(n):
        out[r] = _sample_row(logits[r].astype(np.float32, copy=False), params[r], r)
    return out


def _sample_row(row: np.ndarray, p: np.void, r: int) -> int:
    temperature, top_p, top_k = float(p["temperature"]), float(p["top_p"]), int(p["top_k"])
    best = int(np.argmax(row))  # argmax stops at the first NaN, so one pass checks both
    if not row[best] < np.inf:
        raise ValueError(f"sample: row {r}: logits contain NaN or +inf")
    if np.isnan(temperature):
        raise ValueError(f"sample: row {r}: temperature is NaN")
    if temperature <= 0:
        return best
    if not top_p > 0:  # also catches NaN
        raise ValueError(f"sample: row {r}: top_p must be in (0, 1] (>= 1 disables), got {top_p}")
    if row[best] == -np.inf:
        raise ValueError(f"sample: row {r}: every logit is -inf")
    logits = row / np.float32(temperature)
    vocab = logits.shape[0]
    if 0 < top_k < vocab:
        kth = np.partition(logits, vocab - top_k)[vocab - top_k]
        above = np.flatnonzero(logits > kth)
        ties = np.flatnonzero(logits == kth)[: top_k - above.shape[0]]
        ids = np.sort(np.concatenate([above, ties]))
        vals = logits[ids]
    else:
        ids, vals = None, logits
    order = np.argsort(-vals, kind="stable")  # descending; stable keeps ties by id
    ids = order if ids is None else ids[order]
    vals = vals[order]
    probs = np.exp(vals - vals[0])
    probs /= probs.sum(dtype=np.float32)
    if top_p < 1:
        keep = int(np.searchsorted(np.cumsum(probs), np.float32(top_p), side="left")) + 1
        probs = probs[:keep]
    cdf = np.cumsum(probs)
    u = uniform(int(p["seed"]), int(p["counter"]))
    j = int(np.searchsorted(cdf, np.float32(u) * cdf[-1], side="right"))
    return int(ids[min(j, int(np.count_nonzero(probs)) - 1)])


#: The most alternatives :func:`logprobs` reports per token (OpenAI's ``top_logprobs``).
MAX_TOP_LOGPROBS = 20


def logprobs(
    logits: np.ndarray, ids: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Log-probabilities of the model's distribution (the raw logits: before temperature,
    top-k or top-p), per row of float32 ``logits[n, vocab]``.

    Returns float64 ``(chosen[n], top_ids[n, k], top_logprobs[n, k])``: the log-probability
    of ``ids[r]`` in row ``r`` (NaN for an id outside the vocabulary), and the ``k`` most
    likely ids with theirs, most likely first. Computed as ``l - max - log(sum(exp(l -
    max)))`` in float64. The order is by the logit, descending (a logprob is the logit less
    one constant per row), equal logits by ascending id: exact, whatever the rounding.
    """
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"logprobs: logits must be [n, vocab], got {x.shape}")
    n, vocab = x.shape
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.shape[0] != n or not 0 <= k <= vocab:
        raise ValueError(f"logprobs: {ids.shape[0]} ids and k={k} for logits {x.shape}")
    x64 = x.astype(np.float64)
    peak = x64.max(axis=1, keepdims=True)
    lp = x64 - peak - np.log(np.exp(x64 - peak).sum(axis=1, keepdims=True))
    valid = (ids >= 0) & (ids < vocab)
    chosen = np.where(valid, lp[np.arange(n), np.where(valid, ids, 0)], np.nan)
    top_ids = np.empty((n, k), dtype=np.int64)
    if k:
        for r in range(n):
            if k < vocab:
                cand = np.argpartition(-x[r], k - 1)[:k]
                # Ties at the k-th value: every id with it competes, lower ids first.
                cand = np.union1d(cand, np.flatnonzero(x[r] == x[r, cand].min()))
            else:
                cand = np.arange(vocab)
            order = np.lexsort((cand, -x[r, cand]))
            top_ids[r] = cand[order[:k]]
    return chosen, top_ids, np.take_along_axis(lp, top_ids, axis=1)


def logprobs_op(a: dict[str, Any]) -> None:
    """The reference of the op ``logprobs`` (:data:`vt.OPS`): :func:`logprobs` of the rows
    ``a["rows"]`` of ``a["logits"]`` and ``a["ids"]``, into float32 ``chosen``,
    ``top_logprobs`` and int32 ``top_ids``."""
    logits, rows = a["logits"], np.asarray(a["rows"], dtype=np.int64).reshape(-1)
    bad = rows[(rows < 0) | (rows >= logits.shape[0])]
    if bad.size:
        raise ValueError(f"logprobs: row {int(bad[0])} is outside 0..{logits.shape[0] - 1}")
    k = a["top_ids"].shape[1]
    chosen, top_ids, top_lp = logprobs(logits[rows], np.asarray(a["ids"])[rows], k)
    a["chosen"][...] = chosen
    a["top_ids"][...] = top_ids
    a["top_logprobs"][...] = top_lp
