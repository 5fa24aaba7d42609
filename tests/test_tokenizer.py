"""The GGUF tokenizer: byte-level BPE (gpt2) and SentencePiece (llama), special tokens,
BOS/EOS/stop ids, and the incremental detokenizer."""

from __future__ import annotations

from typing import Any

import pytest
from vt import ModelError
from vt.model import Tokenizer, load_gguf, resolve_model
from vt.testing.tiny import tiny_vocab, write_tiny_gguf

ROUND_TRIP = [
    "The capital of France is Paris.",
    "digits 0123456789 and 3.14159, 1,000,000",
    "héllo wörld — naïve café",
    "日本語のテキスト 中文 한국어",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧",
    "  leading spaces\n\n\ttabs and\r\nCRLF  ",
    "<|im_start|>user\nHi<|im_end|>\n",
    "",
]


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = write_tiny_gguf(tmp_path_factory.mktemp("tok") / "tiny.gguf")
    return Tokenizer.from_model(load_gguf(path))


def _tiny_metadata(**overrides: Any) -> dict[str, Any]:
    tokens, types, merges = tiny_vocab(300)
    md: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    for key, value in overrides.items():
        key = "tokenizer.ggml." + key
        if value is None:
            md.pop(key, None)
        else:
            md[key] = value
    return md


# --------------------------------------------------------------------------- byte-level BPE


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tiny_tok: Tokenizer, text: str) -> None:
    ids = tiny_tok.encode(text)
    assert all(0 <= i < tiny_tok.vocab_size for i in ids)
    assert tiny_tok.decode(ids) == text


def test_merges_apply_and_digits_split_one_by_one(tiny_tok: Tokenizer) -> None:
    ids = tiny_tok.encode(" the the")
    assert [tiny_tok.tokens[i] for i in ids] == ["Ġthe", "Ġthe"]  # learnt merges
    digits = tiny_tok.encode("12345")
    assert [tiny_tok.decode([i]) for i in digits] == ["1", "2", "3", "4", "5"]


def test_special_tokens_encode_as_one_id(tiny_tok: Tokenizer) -> None:
    ids = tiny_tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ids.count(1) == 1 and ids.count(2) == 1
    assert tiny_tok.decode(ids, skip_special=True) == "user\nHi"


def test_bos_eos_and_stop_ids(tiny_tok: Tokenizer) -> None:
    assert (tiny_tok.bos_id, tiny_tok.eos_id) == (1, 2)
    assert not tiny_tok.add_bos  # the tiny model says add_bos_token = false
    assert tiny_tok.encode("hi")[0] != 1
    # EOS plus every end-of-turn token the vocabulary has (<|endoftext|> is id 0).
    assert tiny_tok.stop_ids == {0, 2}


def test_add_bos_and_eos_from_metadata() -> None:
    tok = Tokenizer.from_metadata(
        _tiny_metadata(add_bos_token=True, add_eos_token=True, bos_token_id=0)
    )
    ids = tok.encode("hi")
    assert ids[0] == 0 and ids[-1] == 2
    assert tok.encode("hi", add_special=False) == ids[1:-1]
    assert tok.encode("<|endoftext|>hi")[:2] == [0, ids[1]]  # BOS not doubled


def test_incremental_decoder_holds_back_partial_characters(tiny_tok: Tokenizer) -> None:
    text = "a😀b é日"
    ids = tiny_tok.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several byte tokens
    dec = tiny_tok.incremental_decoder()
    pieces = [dec.step(i) for i in ids]
    assert "".join(pieces) + dec.flush() == text
    for piece in pieces:
        assert "\ufffd" not in piece
    # The emoji's first bytes produce nothing until its last byte arrives.
    emoji_ids = tiny_tok.encode("😀")
    dec = tiny_tok.incremental_decoder()
    assert [dec.step(i) for i in emoji_ids] == [""] * (len(emoji_ids) - 1) + ["😀"]


def test_incremental_decoder_flushes_incomplete_tail(tiny_tok: Tokenizer) -> None:
    dec = tiny_tok.incremental_decoder()
    first = tiny_tok.encode("😀")[0]
    assert dec.step(first) == ""
    assert dec.flush() == "\ufffd"
    assert tiny_tok.decode([first]) == "\ufffd"


def test_incremental_decoder_skip_special(tiny_tok: Tokenizer) -> None:
    ids = tiny_tok.encode("<|im_end|>ok")
    dec = tiny_tok.incremental_decoder(skip_special=True)
    pieces = [dec.step(i) for i in ids]
    assert pieces[0] == "" and "".join(pieces) == "ok"
    keep = tiny_tok.incremental_decoder()
    assert "".join(keep.step(i) for i in ids) == "<|im_end|>ok"


def test_decode_rejects_unknown_ids(tiny_tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="token id 300 is outside the vocabulary of 300"):
        tiny_tok.decode([5, 300])
    with pytest.raises(TypeError, match="text must be a str"):
        tiny_tok.encode(b"bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("smollm", ["abc", "Ġ", "1", "2", "3", "4", "5", "Ġit", "'s"]),
        ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5", "Ġit", "'s"]),
        ("llama-bpe", ["abc", "Ġ", "123", "45", "Ġit", "'s"]),
        ("gpt2", ["abc", "Ġ12345", "Ġit", "'s"]),
        ("something-new", ["abc", "Ġ12345", "Ġit", "'s"]),  # unknown: GPT-2's pattern
    ],
)
def test_pre_tokenizer_by_gguf_pre_type(pre: str, pieces: list[str]) -> None:
    tok = Tokenizer.from_metadata(_tiny_metadata(pre=pre))
    assert [p for p, _ in tok.hf.pre_tokenizer.pre_tokenize_str("abc 12345 it's")] == pieces
    assert tok.decode(tok.encode("abc 12345 it's")) == "abc 12345 it's"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"model": None}, "'tokenizer.ggml.model' is missing"),
        ({"model": "bert"}, "unsupported tokenizer model 'bert'.*gpt2, llama"),
        ({"tokens": None}, "'tokenizer.ggml.tokens' is missing"),
        ({"merges": None}, "'tokenizer.ggml.merges' is missing"),
        ({"merges": ["a b", "nospace"]}, r"merges\[1\] = 'nospace'"),
        ({"token_type": [1, 1]}, "token_type has 2 entries for 300 tokens"),
        ({"eos_token_id": 5000}, "eos_token_id' = 5000 is outside the vocabulary"),
    ],
)
def test_bad_tokenizer_metadata(overrides: dict[str, Any], expected: str) -> None:
    with pytest.raises(ModelError, match=expected):
        Tokenizer.from_metadata(_tiny_metadata(**overrides))


# --------------------------------------------------------------------------- SentencePiece


def _spm_metadata(add_space_prefix: bool = True) -> dict[str, Any]:
    pieces = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]
    scores = [0.0, 0.0, 0.0]
    for b in range(256):
        pieces.append(f"<0x{b:02X}>")
        types.append(6)
        scores.append(0.0)
    # Merged pieces in the order SentencePiece merges them (higher score first).
    singles = ["▁", "h", "e", "l", "o", "w", "r", "d", "!"]
    merged = ["he", "ll", "llo", "hello", "▁hello", "or", "ld", "orld", "▁w", "▁world", "▁h"]
    for w in singles:
        pieces.append(w)
        types.append(1)
        scores.append(-100.0)
    for rank, w in enumerate(merged):
        pieces.append(w)
        types.append(1)
        scores.append(100.0 - rank)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def test_sentencepiece_from_scores() -> None:
    md = _spm_metadata()
    tok = Tokenizer.from_metadata(md)
    ids = tok.encode("hello world!")
    pieces = [md["tokenizer.ggml.tokens"][i] for i in ids]
    assert pieces == ["<s>", "▁hello", "▁world", "!"]  # BOS added by default for llama
    assert tok.decode(ids) == "<s>hello world!"
    assert tok.decode(ids, skip_special=True) == "hello world!"
    assert tok.stop_ids == {2}
    # Like llama.cpp, text after a special token gets the space prefix again.
    ids = tok.encode("hello</s>hello", add_special=False)
    assert [md["tokenizer.ggml.tokens"][i] for i in ids] == ["▁hello", "</s>", "▁hello"]


def test_sentencepiece_byte_fallback() -> None:
    md = _spm_metadata()
    tok = Tokenizer.from_metadata(md)
    ids = tok.encode("hé", add_special=False)
    pieces = [md["tokenizer.ggml.tokens"][i] for i in ids]
    assert pieces == ["▁h", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hé"
    dec = tok.incremental_decoder()
    assert [dec.step(i) for i in ids] == [" h", "", "é"]  # streaming keeps the space


def test_sentencepiece_without_space_prefix() -> None:
    md = _spm_metadata(add_space_prefix=False)
    tok = Tokenizer.from_metadata(md)
    ids = tok.encode("hello world", add_special=False)
    assert [md["tokenizer.ggml.tokens"][i] for i in ids] == ["hello", "▁world"]
    assert tok.decode(ids) == "hello world"


def test_sentencepiece_needs_scores_or_merges() -> None:
    md = _spm_metadata()
    del md["tokenizer.ggml.scores"]
    with pytest.raises(ModelError, match="'tokenizer.ggml.scores' is missing"):
        Tokenizer.from_metadata(md)


# --------------------------------------------------------------------------- the default model

# Reference ids from llama.cpp (llama-cpp-python 0.3.36, vocab_only=True):
#   Llama(path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=True)
LLAMA_CPP_IDS = {
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "12345 abc 3.14": [33, 34, 35, 36, 37, 43239, 216, 35, 30, 33, 36],
    "It's 2024's": [1589, 506, 216, 34, 32, 34, 36, 506],
    "<|im_start|>user\nHi<|im_end|>\n": [1, 4093, 198, 26843, 2, 198],
    "  leading spaces\n\n\ttabs": [216, 2899, 5600, 1116, 197, 100, 7366],
}


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.from_model(load_gguf(resolve_model("default", progress=False)))


@pytest.mark.slow
def test_default_model_ids_match_llama_cpp(smollm: Tokenizer) -> None:
    for text, ids in LLAMA_CPP_IDS.items():
        assert smollm.encode(text) == ids, text
    assert smollm.encode("The capital of France is") == [504, 3575, 282, 4649, 314]


@pytest.mark.slow
def test_default_model_specials_and_round_trip(smollm: Tokenizer) -> None:
    assert (smollm.bos_id, smollm.eos_id, smollm.add_bos) == (1, 2, False)
    assert smollm.stop_ids == {0, 2}  # <|im_end|> (EOS) and <|endoftext|>
    assert smollm.vocab_size == 49152
    for text in ROUND_TRIP:
        assert smollm.decode(smollm.encode(text)) == text


def test_token_lookup_helpers(tiny_tok: Tokenizer) -> None:
    assert tiny_tok.id_of("<|im_end|>") == 2
    assert tiny_tok.id_of("definitely not a token") is None
    assert "300 tokens" in repr(tiny_tok)


@pytest.mark.slow
def test_oracle_prompts_tokenize_as_llama_cpp(smollm: Tokenizer) -> None:
    """Every prompt of the llama.cpp greedy fixture encodes to llama.cpp's prompt ids."""
    import json
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "llama_cpp_greedy.json"
    for rec in json.loads(fixture.read_text())["records"]:
        assert smollm.encode(rec["prompt"]) == rec["prompt_ids"], rec["prompt"]
