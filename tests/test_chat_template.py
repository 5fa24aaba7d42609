"""Chat templates: rendering, the ChatML fallback, message validation, and the sandbox that
keeps an untrusted GGUF's template from doing anything but produce text."""

from __future__ import annotations

import inspect
import logging
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
from vt import ModelError
from vt.model import (
    ChatTemplate,
    ChatTemplateError,
    RenderLimits,
    TemplateRenderer,
    Tokenizer,
    load_gguf,
    resolve_model,
)
from vt.testing.tiny import write_tiny_gguf

USER_HI = [{"role": "user", "content": "Hi"}]


def _template(source: str) -> ChatTemplate:
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>")


def test_tiny_model_chatml(tmp_path: Path) -> None:
    mf = load_gguf(write_tiny_gguf(tmp_path / "t.gguf"))
    ct = ChatTemplate.from_model(mf)
    assert not ct.is_fallback
    msgs = [{"role": "system", "content": "Be brief."}, *USER_HI]
    assert ct.render(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ct.render(USER_HI, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"
    assert (ct.bos_token, ct.eos_token) == ("<|im_start|>", "<|im_end|>")
    # The rendered prompt tokenizes with the specials as single ids.
    ids = Tokenizer.from_model(mf).encode(ct.render(USER_HI))
    assert ids.count(1) == 2 and ids.count(2) == 1


def test_fallback_to_chatml_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mf = load_gguf(write_tiny_gguf(tmp_path / "t.gguf", chat_template=None))
    with caplog.at_level(logging.WARNING):
        ct = ChatTemplate.from_model(mf)
    assert ct.is_fallback
    assert "no chat template" in caplog.text and "ChatML" in caplog.text
    assert ct.render(USER_HI) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_template_variables_and_helpers() -> None:
    ct = _template(
        "{{ bos_token }}{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}"
        "{% if add_generation_prompt %}GO{% endif %}{{ eos_token }}|{{ messages | tojson }}"
        "|{{ extra }}"
    )
    out = ct.render([{"role": "user", "content": "héllo"}], extra="x")
    assert out == '<s>user=héllo;GO</s>|[{"role": "user", "content": "héllo"}]|x'


def test_raise_exception_from_template() -> None:
    ct = _template(
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversations must start with a user message') }}{% endif %}ok"
    )
    assert ct.render(USER_HI) == "ok"
    with pytest.raises(ChatTemplateError, match="must start with a user message"):
        ct.render([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__ }}",
        "{{ messages.__class__.__mro__ }}",
        "{{ messages[0].__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{% set _ = messages.append({'role': 'x'}) %}",
        "{% set _ = messages[0].update({'role': 'x'}) %}",
    ],
)
def test_unsafe_templates_are_stopped(source: str) -> None:
    ct = _template(source)
    with pytest.raises(ChatTemplateError, match="unsafe") as err:
        ct.render(USER_HI)
    assert isinstance(err.value, ModelError)


def test_sandbox_escape_does_not_execute(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    source = (
        "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
        "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.popen('id') }}"
    )
    with pytest.raises(ChatTemplateError):
        _template(source).render(USER_HI)
    assert not marker.exists()


def test_invalid_template_syntax() -> None:
    with pytest.raises(ChatTemplateError, match="chat template is invalid"):
        _template("{% for m in messages %}{{ m.content }}")


def test_template_runtime_errors_are_clear() -> None:
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        _template("{{ messages[5]['content'] + 1 }}").render(USER_HI)


@dataclass
class Msg:
    role: str
    content: str


def test_message_objects_are_accepted() -> None:
    ct = _template("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }} {% endfor %}")
    assert ct.render([Msg("user", "a"), Msg("assistant", "b")]) == "user:a assistant:b "


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ("hello", "messages must be a list"),
        ([], "messages is empty"),
        ([{"content": "x"}], r"messages\[0\]: 'role' must be a non-empty string"),
        ([{"role": "", "content": "x"}], r"messages\[0\]: 'role'"),
        ([{"role": 3, "content": "x"}], r"messages\[0\]: 'role'"),
        ([*USER_HI, {"role": "user"}], r"messages\[1\] \(user\): 'content' must be a string"),
        ([{"role": "user", "content": 5}], r"'content' must be a string, got int"),
        ([42], r"messages\[0\] must be a dict with 'role' and 'content', got int"),
    ],
)
def test_bad_messages(messages: object, expected: str) -> None:
    ct = _template("{{ messages | length }}")
    with pytest.raises(ValueError, match=expected):
        ct.render(messages)


@pytest.mark.slow
def test_default_model_template_inserts_default_system_message() -> None:
    mf = load_gguf(resolve_model("default", progress=False))
    ct = ChatTemplate.from_model(mf)
    assert not ct.is_fallback
    assert ct.render([{"role": "user", "content": "What is 2+2?"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    own = [{"role": "system", "content": "Answer in French."}, *USER_HI]
    assert ct.render(own) == (
        "<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = Tokenizer.from_model(mf).encode(ct.render(own))
    assert ids[:3] == [1, 9690, 198]  # <|im_start|> "system" "\n"


# --------------------------------------------------------------------------- limits (issue 11)

SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE = [
    pytest.param(SPIN, "took longer than 0.5 s and was stopped", id="nested-loops"),
    pytest.param("{{ lipsum(100000) }}", "'lipsum' is undefined", id="lipsum"),
    pytest.param("{{ 'A' * 10**8 }}", "past the limit of 1000000", id="big-string"),
    pytest.param("{{ [0] * 10**9 }}", "past the limit of 1000000", id="big-list"),
    pytest.param("{{ range(10**9) | list }}", "Range too big", id="big-range"),
    pytest.param(
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "recursed too deeply",
        id="recursion",
    ),
    pytest.param("{{ 1 / 0 }}", "ZeroDivisionError: division by zero", id="division"),
    pytest.param("{{ 'a'.center(10**9) }}", "'center' got 1000000000", id="center"),
    pytest.param("{{ 'a' | center(10**9) }}", "filter 'center' got", id="center-filter"),
    pytest.param("{{ '{:>999999999}'.format(1) }}", "asks for width", id="format-width"),
    pytest.param("{{ '%0999999999d' % 1 }}", "asks for width", id="percent-width"),
    pytest.param("{{ 7 ** (10**8) }}", "exponent 100000000", id="power"),
    pytest.param(
        "{% for i in range(20000) %}{{ 'x' * 100 }}{% endfor %}",
        "the output passed 1000000 characters",
        id="big-output",
    ),
    pytest.param(
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
        "'+' would make a value",
        id="doubling",
    ),
]


@pytest.mark.parametrize(("source", "message"), HOSTILE)
def test_hostile_templates_stop_with_a_one_line_error(source: str, message: str) -> None:
    template = ChatTemplate(source, limits=RenderLimits(timeout_s=0.5))
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError) as err:
        template.render(USER_HI)
    assert time.monotonic() - t0 < 3
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    assert not err.value.refused


def test_a_template_refusing_is_not_a_broken_template() -> None:
    with pytest.raises(ChatTemplateError) as err:
        _template("{{ raise_exception('no system messages') }}").render(USER_HI)
    assert err.value.refused


def test_renderer_processes_stop_runaway_and_memory_hungry_renders() -> None:
    # A template that misbehaves only for some content passes the check at load; each
    # bad render is stopped, and the next render works.
    source = (
        "{% for m in messages %}"
        "{% if m.content == 'spin' %}" + SPIN + "{% endif %}"
        "{% if m.content == 'grow' %}{% set ns = namespace(s='ab') %}"
        "{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{% endif %}"
        "{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    limits = RenderLimits(timeout_s=1.0, memory_bytes=384 << 20, workers=1)
    renderer = TemplateRenderer(ChatTemplate(source), limits)
    try:
        assert renderer.probe_error is None
        assert renderer.render(USER_HI) == "user: Hi\n"
        t0 = time.monotonic()
        with pytest.raises(ChatTemplateError, match="took longer than 1 s and was stopped"):
            renderer.render([{"role": "user", "content": "spin"}])
        assert time.monotonic() - t0 < 4
        with pytest.raises(ChatTemplateError, match="out of memory|process died"):
            renderer.render([{"role": "user", "content": "grow"}])
        assert renderer.render(USER_HI) == "user: Hi\n"
        with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
            TemplateRenderer(ChatTemplate("{{ 1/0 }}"), limits).render(USER_HI)
    finally:
        renderer.close()


def test_renderer_checks_the_template_at_load() -> None:
    limits = RenderLimits(timeout_s=0.5, workers=1)
    broken = TemplateRenderer(ChatTemplate(SPIN), limits)
    try:
        assert broken.probe_error is not None and "took longer than 0.5 s" in broken.probe_error
        t0 = time.monotonic()
        with pytest.raises(ChatTemplateError, match="when the server checked it at load"):
            broken.render(USER_HI)
        assert time.monotonic() - t0 < 0.1  # not run again
    finally:
        broken.close()
    picky = TemplateRenderer(
        ChatTemplate(
            "{% if messages | length > 1 %}{{ raise_exception('one only') }}{% endif %}"
            "{{ messages[0].content }}"
        ),  # fmt: skip
        limits,
    )
    try:
        assert picky.probe_error is None  # refusing a conversation is not being broken
        assert picky.render(USER_HI) == "Hi"
    finally:
        picky.close()


def test_a_recursing_template_stops_with_the_stack_to_spare() -> None:
    """A macro calling itself stops after MAX_NESTING template calls, far below Python's
    recursion limit, so whatever else runs at that moment still has stack: a garbage
    collection's finalizer (the cpu backend closes its streams in one) used to fail there
    with 'Exception ignored in: <finalize object ...>' when the render ran into the limit."""
    from vt.model import template_sandbox as sandbox

    template = sandbox.make_environment().from_string(
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
    )
    with pytest.raises(RecursionError, match="more than 100 nested template calls") as info:
        sandbox.render_limited(template, {})
    deepest = len(inspect.stack(0)) + len(traceback.extract_tb(info.value.__traceback__))
    assert deepest < sys.getrecursionlimit() // 2
    # 91 nested calls, five times in one render: the count unwinds as the calls return
    nested = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{% endif %}x{% endmacro %}"
    nested += "{{ f(90) }}{{ f(90) }}{% for i in range(3) %}{{ f(90) }}{% endfor %}"
    text = sandbox.render_limited(sandbox.make_environment().from_string(nested), {})
    assert text == "x" * 455


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ 1/0 }}", "the model's chat template failed: ZeroDivisionError: division by zero"),
        ("{{ range(10**9) | list }}", "OverflowError: Range too big"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
        ("{{ 'A' * 10**8 }}", "was stopped: '*' would make a value of 100000000 items"),
        ("{% for m in messages %}", "the model's chat template is invalid (line 1)"),
    ],
)
def test_vt_run_reports_template_errors_in_one_line(
    tmp_path: Path, source: str, message: str
) -> None:
    from click.testing import CliRunner
    from vt.frontends.cli import main

    model = write_tiny_gguf(tmp_path / "t.gguf", chat_template=source)
    result = CliRunner().invoke(main, ["run", "--model", str(model), "--backend", "cpu", "Hi"])
    assert result.exit_code == 1, result.output
    # One error line (a backend may also say it compiles its kernels on first use).
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    # (once, in a clean-clone CI run, no line started with "Error: ": the output says why)
    assert len(errors) == 1 and message in errors[0], (result.output, result.exception)
    assert "Traceback" not in result.output
    raw = ["run", "--model", str(model), "--backend", "cpu", "--raw", "-n", "2", "Hi"]
    assert CliRunner().invoke(main, raw).exit_code == 0  # the model itself is fine
