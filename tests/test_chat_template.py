"""Chat templates: rendering, the ChatML fallback, message validation, and the sandbox that
keeps an untrusted GGUF's template from doing anything but produce text."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
from vt import ModelError
from vt.model import ChatTemplate, ChatTemplateError, Tokenizer, load_gguf, resolve_model
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
