"""The server's engine thread (``EngineLoop``): what a handler's queue receives."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import vt
from vt.frontends.server.engine_loop import Delivery, EngineLoop, Prompt
from vt.testing.tiny import write_tiny_gguf

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    path: Path = write_tiny_gguf(tmp_path_factory.mktemp("loop") / "tiny.gguf", tied=False)
    with vt.LLM(model=path, backend="cpu", max_slots=2) as llm:
        yield llm


def _deliveries(llm: vt.LLM, finals_only: bool) -> list[Delivery]:
    loop_thread = EngineLoop(llm.engine)
    loop_thread.start()
    params = vt.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [Prompt(llm.encode("The capital of France is")), Prompt(llm.encode("Hello"))]

    async def run() -> list[Delivery]:
        queue: asyncio.Queue[Delivery] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop_thread.submit("r", prompts, params, queue, loop, finals_only=finals_only)
        items, finished = [], 0
        while finished < len(prompts):
            item = await asyncio.wait_for(queue.get(), 30)
            items.append(item)
            finished += bool(item.output is not None and item.output.finished)
        return items

    try:
        return asyncio.run(run())
    finally:
        loop_thread.stop()


def test_a_non_streaming_request_gets_only_its_final_outputs(llm: vt.LLM) -> None:
    built: list = []  # what the engine's steps returned (on the engine thread)
    step = llm.engine.step

    def recording() -> list:
        outs = step()
        built.extend(outs)
        return outs

    llm.engine.step = recording
    try:
        finals = _deliveries(llm, finals_only=True)
        # added final_only: the engine built no output before each request finished
        assert len(built) == 2 and all(o.finished for o in built)
    finally:
        del llm.engine.step
    streamed = _deliveries(llm, finals_only=False)
    assert finals[0].accepted and len(finals) == 3  # accepted, then one final per prompt
    assert all(d.output.finished for d in finals[1:])
    assert len(streamed) > 3 and streamed[0].accepted
    for index in (0, 1):
        want = [d.output for d in streamed[1:] if d.index == index][-1]
        got = next(d.output for d in finals[1:] if d.index == index)
        assert got.ids == want.ids and len(got.ids) == 8 and got.text == want.text
