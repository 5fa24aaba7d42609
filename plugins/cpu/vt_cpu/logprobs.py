"""The CPU backend's ``logprobs`` op: one numba kernel over the rows that asked.

Per row: the float64 maximum, the float64 sum of ``exp(l - max)`` and, in the same pass
over the vocabulary, the ``k`` best ids kept sorted by (logit desc, id asc) in a small
insertion list (an id is compared with the k-th best first, so most cost one comparison).
Results are rounded to float32 as ``vt.reference.sampling.logprobs_op`` rounds them; the
sums run in another order than numpy's, within the kit's bound (``logprobs`` in
``vt.testing.tolerances``). Memory is host-addressable, so nothing is copied: the runner
reads the results where the op wrote them.
"""

from __future__ import annotations

import math

import numpy as np
import vt
from numba import njit


@njit(cache=True, nogil=True, boundscheck=False)
def logprobs_rows(logits, ids, rows, chosen, top_ids, top_lp):  # noqa: ANN001, ANN201
    """Fill ``chosen[m]``, ``top_ids[m, k]``, ``top_lp[m, k]`` for ``logits[rows[i]]``;
    returns the index of the first row outside ``logits`` (nothing written from it), or -1."""
    n, vocab = logits.shape
    m, k = top_ids.shape
    tv = np.empty(max(k, 1), np.float32)
    ti = np.empty(max(k, 1), np.int32)
    for i in range(m):
        r = rows[i]
        if r < 0 or r >= n:
            return i
        peak = -math.inf
        for j in range(vocab):
            v = np.float64(logits[r, j])
            if v > peak:
                peak = v
        s = 0.0
        count = 0
        for j in range(vocab):
            x = logits[r, j]
            s += math.exp(np.float64(x) - peak)
            if k == 0 or (count == k and not x > tv[k - 1]):
                continue  # ids ascend: an equal logit later in the row ranks after
            p = count if count < k else k - 1
            while p > 0 and x > tv[p - 1]:
                tv[p] = tv[p - 1]
                ti[p] = ti[p - 1]
                p -= 1
            tv[p] = x
            ti[p] = j
            if count < k:
                count += 1
        ls = math.log(s)
        c = ids[r]
        if 0 <= c < vocab:
            chosen[i] = (np.float64(logits[r, c]) - peak) - ls
        else:
            chosen[i] = np.nan
        for q in range(k):
            top_ids[i, q] = ti[q]
            top_lp[i, q] = (np.float64(tv[q]) - peak) - ls
    return -1


class LogprobsOp(vt.Backend):
    """Mixin of :class:`vt_cpu.backend.CpuBackend`: the native ``logprobs`` op."""

    def op_logprobs(
        self,
        stream: vt.Stream,
        chosen: vt.Tensor,
        top_ids: vt.Tensor,
        top_logprobs: vt.Tensor,
        logits: vt.Tensor,
        ids: vt.Tensor,
        rows: vt.Tensor,
    ) -> None:
        arrays = [self._array(t) for t in (logits, ids, rows, chosen, top_ids, top_logprobs)]  # type: ignore[attr-defined]
        kernel, n = logprobs_rows, logits.shape[0]

        def run() -> None:
            bad = kernel(*arrays)
            if bad >= 0:
                row = int(arrays[2][bad])
                raise ValueError(f"logprobs: row {row} is outside 0..{n - 1}")

        self.enqueue_host(stream, "logprobs", run)
