"""``vt.LLM``: offline generation in the style of vLLM's ``LLM`` class.

    >>> import vt
    >>> with vt.LLM() as llm:                      # the default model, auto backend
    ...     out = llm.generate("The capital of France is", vt.SamplingParams(temperature=0))
    ...     print(out[0].text)

Every call runs through the same :class:`~vt.frontends.engine.Engine` that ``vt serve`` uses, so
``generate`` with many prompts batches them (continuous batching over ``max_slots`` KV
slots).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import VtError
from .engine import Engine, RequestError, RequestOutput, Timings
from .sampling import SamplingParams

__all__ = ["LLM", "RequestError", "RequestOutput", "SamplingParams", "Timings"]

Message = Mapping[str, str]
Prompt = str | Mapping[str, Any]  # text, or {"prompt_token_ids": [...]} as in vLLM


class LLM:
    """A model loaded on a backend, ready to generate.

    ``model`` is a GGUF path or a model name (None: the default model, fetched on first
    use). ``backend`` is a backend name or ``"auto"`` (None: ``VT_BACKEND``, else auto).
    ``kv_cache`` is ``auto`` | ``contiguous`` | ``vmm``; ``max_model_len`` caps prompt plus
    generated tokens of one sequence; ``max_slots`` sequences run at once, and one step holds
    at most ``max_batch_tokens`` tokens (long prompts are prefilled in chunks of that size;
    None: the backend's ``default_batch_tokens``, 256 on cpu, 512 on a GPU).
    ``async_scheduling=None`` follows ``VT_ASYNC_RUNNER`` (default on). With
    ``prefix_caching`` a prompt skips the prefix it shares with a free KV slot's earlier
    request (:mod:`vt.frontends.prefix_cache`).

    The backend is verified before it is used
    (:func:`vt.management.trust.open_verified_backend`: the
    audit's probes, cached per backend, version, device and capabilities); a failing probe
    raises :class:`vt.BackendVerificationError`. ``verify=None`` follows ``VT_VERIFY``
    (default on), False skips it. ``verification`` says what happened.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        backend: str | None = None,
        *,
        kv_cache: str = "auto",
        max_model_len: int | None = None,
        max_slots: int = 8,
        max_batch_tokens: int | None = None,
        async_scheduling: bool | None = None,
        verify: bool | None = None,
        prefix_caching: bool = True,
    ) -> None:
        from ..execution.runner import ModelRunner
        from ..management.trust import open_verified_backend
        from ..model import ChatTemplate, Tokenizer, load_gguf
        from ..model.cache import resolve_model

        self._closed = False
        self.backend: Any = None
        self.model_file: Any = None
        self.runner: Any = None
        try:
            self.model_path: Path = Path(resolve_model(None if model is None else str(model)))
            opened = open_verified_backend(backend, verify=verify)
            self.backend, self.backend_reason, self.verification = opened
            self.model_file = load_gguf(self.model_path)
            self.tokenizer = Tokenizer.from_model(self.model_file)
            self.chat_template = ChatTemplate.from_model(self.model_file)
            self.runner = ModelRunner(
                self.backend,
                self.model_file,
                max_slots=max_slots,
                max_model_len=max_model_len,
                max_batch_tokens=max_batch_tokens,
                kv_cache=kv_cache,
                async_scheduling=async_scheduling,
            )
            self.engine = Engine(self.runner, self.tokenizer, prefix_caching=prefix_caching)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ facts
    @property
    def backend_name(self) -> str:
        return str(self.backend.name)

    @property
    def model_name(self) -> str:
        return str(self.model_file.config.name)

    @property
    def readback(self) -> str:
        """``host_view``, ``async_d2h`` or ``sync``: how sampled ids reach the host."""
        return str(self.runner.readback)

    @property
    def readback_reason(self) -> str:
        return str(self.runner.readback_reason)

    @property
    def max_model_len(self) -> int:
        return int(self.runner.max_model_len)

    def kv_cache_stats(self) -> dict[str, Any]:
        """``{"backend", "reserved_bytes", "mapped_bytes", "segments"}`` of the KV cache."""
        return self.runner.kv.stats().model_dump()

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt (BOS as the model asks), or the ids given."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            return [int(i) for i in prompt["prompt_token_ids"]]
        raise TypeError(
            "a prompt is a str or {'prompt_token_ids': [...]}, got " + type(prompt).__name__
        )

    def render_chat(self, messages: Sequence[Message], system: str | None = None) -> str:
        """The prompt text the model's chat template makes of ``messages``."""
        msgs = [dict(m) for m in messages]
        if system is not None and not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": system})
        return self.chat_template.render(msgs, add_generation_prompt=True)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (no chat template); one output per prompt, in order.

        ``sampling_params`` is one for all prompts or a list with one per prompt. A bad
        prompt (too long, empty) raises :class:`RequestError` before anything runs.
        """
        items = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        texts = [p if isinstance(p, str) else None for p in items]
        return self._run([self.encode(p) for p in items], texts, sampling_params)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        system: str | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or a list of them.

        ``system`` adds a system message to conversations that have none.
        """
        convs = _conversations(messages)
        texts = [self.render_chat(c, system) for c in convs]
        return self._run([self.encode(t) for t in texts], texts, sampling_params)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield a :class:`RequestOutput` each time the request gains text or finishes.

        Each output carries the new ``delta_text``/``delta_ids`` and everything so far;
        the last one has ``finished=True``. Closing the iterator early aborts the request.
        """
        self._check_open()
        text = prompt if isinstance(prompt, str) else None
        rid = self.engine.add_request(self.encode(prompt), sampling_params, prompt=text)
        return self._follow(rid)

    def stream_chat(
        self,
        messages: Sequence[Message],
        sampling_params: SamplingParams | None = None,
        system: str | None = None,
    ) -> Iterator[RequestOutput]:
        """:meth:`stream` for one conversation, through the chat template."""
        return self.stream(self.render_chat(messages, system), sampling_params)

    def _follow(self, rid: str) -> Iterator[RequestOutput]:
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
                if not self.engine.has_unfinished() and not done:
                    raise RuntimeError(f"request {rid} vanished from the engine")
        finally:
            if not done:
                self.engine.abort(rid)

    def _run(
        self,
        prompt_ids: list[list[int]],
        texts: list[str | None],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        self._check_open()
        params = _params_for(sampling_params, len(prompt_ids))
        # Refuse a bad prompt before any request runs, so a batch fails as a whole.
        for i, ids in enumerate(prompt_ids):
            self._check_prompt(ids, i if len(prompt_ids) > 1 else None)
        rids: list[str] = []
        finals: dict[str, RequestOutput] = {}
        try:
            for ids, text, p in zip(prompt_ids, texts, params, strict=True):
                rids.append(self.engine.add_request(ids, p, prompt=text, final_only=True))
            wanted = set(rids)
            while len(finals) < len(rids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finals[out.request_id] = out
                if not self.engine.has_unfinished() and len(finals) < len(rids):
                    raise RuntimeError("the engine stopped before every request finished")
        finally:
            for rid in rids:
                if rid not in finals:
                    self.engine.abort(rid)
        return [finals[r] for r in rids]

    def _check_prompt(self, ids: list[int], index: int | None) -> None:
        where = "" if index is None else f"prompt {index}: "
        if not ids:
            raise RequestError(f"{where}the prompt is empty: it needs at least one token")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"{where}the prompt has {len(ids)} tokens but max_model_len is "
                f"{self.max_model_len}; it must be shorter to leave room for at least one "
                "generated token (raise max_model_len or shorten the prompt)"
            )

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise VtError("this LLM is closed")

    def close(self) -> None:
        """Release the runner, the model file and the backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.runner is not None:
            self.runner.close()
        if self.model_file is not None:
            self.model_file.close()
        if self.backend is not None:
            self.backend.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"LLM(model={self.model_name!r}, backend={self.backend_name!r}, "
            f"readback={self.readback!r}, max_model_len={self.max_model_len})"
        )


def _conversations(messages: Any) -> list[list[Message]]:
    if isinstance(messages, Sequence) and messages and not isinstance(messages, str):
        first = messages[0]
        if isinstance(first, Sequence) and not isinstance(first, (str, Mapping)):
            return [list(c) for c in messages]
    return [list(messages)]


def _params_for(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
