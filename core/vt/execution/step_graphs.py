"""Steps captured once per shape and replayed as graphs (backends declaring ``graphs``).

A decode step (every chunk one sampled token, whether its input id comes from the previous
step on the device, with async scheduling, or from the host, without) enqueues the same
launches per layer every time; only the *contents* of its input buffers change. Where the
backend's effective capabilities declare ``graphs``, :class:`StepGraphs` records that
kernel sequence once per shape and replays it with one launch.

Decode steps are padded to a bucket (1, 2, 4, 8, 16, 32, ... rows, at most the runner's
``max_rows``), so a batch that shrinks as requests finish reuses a few graphs instead of
capturing one per size. A padding row (:func:`padding`) is a copy of nothing real: token 0
at the position just past one real row's, in that row's KV slot, sampled greedily and never
read back. Its KV write lands on a position of that slot no step has read yet, and the slot
writes that position itself before any step reads it (kv_store comes before attention in
every layer), so real sequences never see it; the padding rows write identical values, and
every op treats rows independently, so the real rows' results do not change.

What a graph may capture, and why replays are right:

- Kernel arguments are frozen at capture: buffer addresses, row counts, the KV layout.
  Every address the forward pass uses is allocated in ``ModelRunner.__init__`` (activations,
  the device inputs, the KV cache), and everything that differs between steps of one shape
  (token ids, positions, KV slots, sampled rows, sampling parameters) is *data* in the
  device inputs buffer. So the key is the shape: ``(n_tokens, n_sampled_rows)``. The row
  -> KV-slot layout is data too, not part of the key. Where the backend declares
  ``context_classes``, the key also holds the step's context bound (:func:`context_bound`):
  its attention kernels may differ by it, and a graph captured at a bound is replayed only
  while every row's context stays within it.
- Only the forward pass is captured. The host inputs' copy from the output slot's pinned
  staging, the device-to-device copies of the previous step's ids, and the copy of the
  sampled ids into the output slot are enqueued eagerly on the same stream around the
  replay: they differ per step (pinned buffer of the slot, previous slot, runs of rows),
  and stream order makes them land before the replay reads them / after it writes them.
  The graph samples into one fixed ids buffer for that reason.
- The ``logprobs`` op of a step whose rows ask for logprobs is not captured either: it is
  launched eagerly after the replay (and after the ids' copy), reading the logits the
  replay left and writing into the output slot. A graph never depends on who asked, so
  asking costs no capture and no graph per combination of asking rows; one launch per
  step is all it adds. (Steps that score prompt tokens are prefill steps: never captured.)
- The KV cache's base address never moves: a contiguous cache is one allocation, and a
  VMM cache grows by mapping more pages inside its fixed reservation. Growth (host-side
  mapping, then zeroing on the stream) happens before the replay is enqueued. As a guard,
  a change of the KV buffer drops every graph (never a replay against a stale address).
- A shape is run eagerly the first time it is seen and captured the second: the eager run
  resolves kernels lazily loaded by the runtime outside any capture, and batch sizes seen
  once never cost a capture.

Prefill and mixed steps (prompt chunks, alone or beside decode rows) replay too where the
backend's ``prefill_graphs`` hint says a step's launches cost more than padding's compute
(a GPU: hundreds of launches a chunk, each several microseconds of host time, against a
few milliseconds of kernels), as vLLM pads its batches to captured token counts:

- the step's rows are padded to :func:`token_bucket` (powers of two to 16, then eight
  sizes an octave: at most an eighth of the rows are padding), its sampled rows to a power
  of two (:func:`bucket`); the key is ``(rows, sampled rows)``, which is all the forward
  pass's launches depend on (decode steps' keys are the same kind: a decode key and a
  prefill key that are equal capture the same launches);
- the padding rows are the decode ones' kind: token 0 at one position just past the end of
  a chunk with room (the last chunk's first, so they extend the rows' last sequence), in
  that chunk's slot, never read back. The padding sampled rows sample the last row into
  the fixed ids buffer, never copied out;
- steps that score prompt tokens (echo) and steps with no chunk that has a position left
  run eagerly at their exact shape.

The cache holds at most ``max_graphs`` graphs (least recently used evicted, after the
stream drains) and :meth:`StepGraphs.close` destroys them all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .. import envs
from ..protocol.backend import Backend, Buffer, Graph, Stream
from ..protocol.capabilities import Capabilities

DEFAULT_MAX_GRAPHS = 64

#: ``(rows, sampled rows, context bound)``: the bound is 0 where the step launches plain
#: attention (:func:`context_bound`).
GraphKey = tuple[int, int, int]


def bucket(n: int, limit: int) -> int:
    """The padded size of a decode step of ``n`` rows: the next power of two, at most
    ``limit`` (never below ``n``)."""
    b = 1
    while b < n:
        b *= 2
    return max(n, min(b, limit))


def token_bucket(n: int, limit: int) -> int:
    """The padded row count of a prefill or mixed step of ``n`` rows: :func:`bucket` up to
    16, then the next multiple of an eighth of the power of two below ``n`` (17 -> 18,
    300 -> 320, 512 -> 512), at most ``limit`` (never below ``n``)."""
    if n <= 16:
        return bucket(n, limit)
    step = 1 << ((n - 1).bit_length() - 4)
    return max(n, min(-(-n // step) * step, limit))


def context_classes(backend: Backend) -> tuple[int, ...]:
    """The backend's ``context_classes`` hint, checked: ValueError naming the backend
    unless it is strictly ascending positive integers."""
    classes = backend.context_classes
    ok = isinstance(classes, (tuple, list)) and all(
        isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in classes
    )
    if not ok or any(b <= a for a, b in zip(classes, classes[1:], strict=False)):
        raise ValueError(
            f"backend {backend.name!r}: context_classes must be strictly ascending positive "
            f"integers (context bounds in positions), got {classes!r}"
        )
    return tuple(classes)


def context_bound(classes: tuple[int, ...], end: int, max_len: int) -> int:
    """The attention bound of a step whose rows end at most at position ``end`` (exclusive):
    the smallest class bound of at least ``end``, at most ``max_len`` (the cache's: no
    position lies past it), else 0: no bound, plain attention."""
    return next((min(c, max_len) for c in classes if end <= c), 0)


def padding(rows: list[tuple[int, int]], max_len: int) -> tuple[int, int] | None:
    """``(slot, position)`` for a step's padding rows, given where each chunk's rows end
    (``(slot, last position)``, in the order to try): one past the first that has a position
    left below ``max_len``, else None."""
    for slot, pos in rows:
        if pos + 1 < max_len:
            return slot, pos + 1
    return None


def prefill_graphs_enabled(
    backend: Backend, graphs_on: bool, prefill_graphs: bool | None = None
) -> tuple[bool, str]:
    """Whether prefill and mixed steps replay too, and why: only with decode graphs on;
    then the argument, then ``VT_PREFILL_GRAPHS``, then the backend's ``prefill_graphs``
    hint."""
    if not graphs_on:
        return False, "graphs are off"
    if prefill_graphs is not None:
        wanted, why = prefill_graphs, f"prefill_graphs={prefill_graphs}"
    elif envs.raw("VT_PREFILL_GRAPHS") is not None:
        wanted, why = envs.bool_with_reason("VT_PREFILL_GRAPHS")
    else:
        wanted = backend.prefill_graphs
        why = f"the {backend.name} backend's prefill_graphs hint"
    if not wanted:
        return False, f"prefill and mixed steps run eagerly ({why})"
    return True, f"prefill and mixed steps are padded to a token bucket and replayed ({why})"


def graphs_enabled(caps: Capabilities, graphs: bool | None = None) -> tuple[bool, str]:
    """Whether decode steps are captured, and why: the argument, then ``VT_GRAPHS``, then
    the backend's *effective* ``graphs`` capability (a request is never honoured without it).
    """
    if graphs is None:
        wanted, why = envs.bool_with_reason("VT_GRAPHS")
        if not wanted:
            return False, why
    elif not graphs:
        return False, "graphs=False"
    else:
        why = "graphs=True"
    if not caps.graphs:
        return False, f"the backend does not declare graphs ({why})"
    return True, f"decode steps are captured once per shape and replayed ({why})"


class StepGraphs:
    """The runner's graph cache, keyed by step shape ``(rows, sampled rows)``."""

    def __init__(
        self, backend: Backend, enabled: bool, max_graphs: int = DEFAULT_MAX_GRAPHS
    ) -> None:
        if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 1:
            raise ValueError(f"max_graphs must be a positive integer, got {max_graphs!r}")
        self.backend = backend
        self.enabled = enabled
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[GraphKey, Graph] = OrderedDict()
        self._seen: set[GraphKey] = set()
        self._kv: tuple[Buffer, object, int] | None = None
        self.captures = 0
        self.replays = 0
        self.evictions = 0
        self.invalidations = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: GraphKey, kv: Buffer, stream: Stream, forward: Callable[[], None]) -> bool:
        """Enqueue the step ``forward`` enqueues: replayed, captured then replayed, or (first
        sight of ``key``) eagerly. True when a graph ran it."""
        self._check_kv(kv, stream)
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._seen:
                self._seen.add(key)
                forward()
                return False
            graph = self._capture(key, stream, forward)
        else:
            self._graphs.move_to_end(key)
        self.backend.launch_graph(graph, stream)
        self.replays += 1
        return True

    def _check_kv(self, kv: Buffer, stream: Stream) -> None:
        ident = (kv, kv.handle, kv.offset)
        if self._kv is not None and (
            self._kv[0] is not kv or self._kv[1] is not kv.handle or self._kv[2] != kv.offset
        ):
            self.invalidations += 1
            self.clear(stream)
        self._kv = ident

    def _capture(self, key: GraphKey, stream: Stream, forward: Callable[[], None]) -> Graph:
        b = self.backend
        if len(self._graphs) >= self.max_graphs:
            _, old = self._graphs.popitem(last=False)
            b.synchronize(stream)  # no replay of it is still pending when it is destroyed
            b.destroy_graph(old)
            self.evictions += 1
        b.begin_capture(stream)
        try:
            forward()
        except BaseException:
            try:
                b.destroy_graph(b.end_capture(stream))
            except Exception:  # the forward pass's error is the one to report
                pass
            raise
        graph = b.end_capture(stream)
        self._graphs[key] = graph
        self.captures += 1
        return graph

    def clear(self, stream: Stream | None) -> None:
        """Destroy every graph (after ``stream`` drains) and forget the shapes seen."""
        graphs, self._graphs = list(self._graphs.values()), OrderedDict()
        self._seen.clear()
        if graphs and stream is not None:
            self.backend.synchronize(stream)
        for graph in graphs:
            self.backend.destroy_graph(graph)

    def close(self, stream: Stream | None) -> None:
        self.clear(stream)
        self._kv = None
