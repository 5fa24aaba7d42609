"""A tokenizer built from GGUF metadata on HF ``tokenizers``.

Two GGUF tokenizer models are supported, as llama.cpp names them:

- ``gpt2``: byte-level BPE from ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``,
  pre-tokenized by the regexes llama.cpp uses for ``tokenizer.ggml.pre``.
- ``llama``: SentencePiece BPE from tokens and scores, with byte fallback (``<0x0A>``),
  merges derived from the scores the way HF transformers' GGUF converter does.

Control (type 3) and user-defined (type 4) tokens are special: ``<|im_start|>`` in text
encodes as one id.
"""

from __future__ import annotations

import codecs
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ..errors import ModelError
from .string_array import ARRAY_TYPES, StringArray

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_LLAMA3 = (
    r"""(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"""
    r"""\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2 = (
    r"""(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"""
    r"""\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
#: SentencePiece merges are derived from tokens of at most this many characters.
MAX_SPLIT_CHARS = 256

#: tokenizer.ggml.pre -> the regexes applied in order (each splits the previous pieces).
PRE_TOKENIZER_PATTERNS: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2,),
    "default": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
}

_IGNORE_MERGES = frozenset({"llama-bpe", "llama3"})

#: Tokens that end a turn in common chat templates; llama.cpp stops on them too.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
    "<|return|>",
)

_SPM_SPACE = "\u2581"  # ▁


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet back to bytes."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: b for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + n
            n += 1
    return {chr(c): b for b, c in table.items()}


def _as_list(
    metadata: Mapping[str, Any], key: str, required: bool = True
) -> list | StringArray | None:
    value = metadata.get(key)
    if value is None:
        if required:
            raise ModelError(f"required metadata {key!r} is missing")
        return None
    if not isinstance(value, ARRAY_TYPES):
        raise ModelError(f"metadata {key!r} must be an array, got {type(value).__name__}")
    return value


def _flag(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean key: a GGUF bool, or absent (``default``); a string is not a boolean."""
    value = metadata.get(key, default)
    if not isinstance(value, bool):
        raise ModelError(f"metadata {key!r} must be a boolean, got {value!r}"[:200])
    return value


def _token_id(metadata: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelError(f"metadata {key!r} must be a token id, got {value!r}")
    if value >= n_vocab:
        raise ModelError(f"metadata {key!r} = {value} is outside the vocabulary of {n_vocab}")
    return value


class Tokenizer:
    """Encode text to token ids and back; build it with :meth:`from_metadata`."""

    def __init__(
        self,
        hf: HFTokenizer,
        tokens: Sequence[str],
        token_types: list[int],
        model: str,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        extra_stop_ids: Iterable[int] = (),
    ) -> None:
        self.hf = hf
        self.tokens = tokens
        self.token_types = token_types
        self.model = model
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.special_ids = frozenset(
            i for i, t in enumerate(token_types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
        )
        ends = frozenset(END_OF_TURN_TOKENS)
        by_text = {t: i for i, t in enumerate(tokens) if t in ends}
        stops = {i for i in (eos_id, *extra_stop_ids) if i is not None}
        stops |= {by_text[t] for t in END_OF_TURN_TOKENS if t in by_text}
        self.stop_ids: frozenset[int] = frozenset(stops)
        self._bytes_cache: dict[int, bytes] = {}

    # ---- construction
    @classmethod
    def from_model(cls, model_file: Any) -> Tokenizer:
        """Build from a :class:`vt.model.ModelFile`."""
        return cls.from_metadata(model_file.metadata)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise ModelError("required metadata 'tokenizer.ggml.model' is missing")
        tokens = _as_list(metadata, "tokenizer.ggml.tokens")
        assert tokens is not None
        strings = isinstance(tokens, StringArray) or all(isinstance(t, str) for t in tokens)
        if not tokens or not strings:
            raise ModelError("metadata 'tokenizer.ggml.tokens' must be a non-empty string array")
        n = len(tokens)
        types = _as_list(metadata, "tokenizer.ggml.token_type", required=False)
        if types is None:
            types = [TOKEN_NORMAL] * n
        if len(types) != n:
            raise ModelError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        if not all(type(t) is int for t in types):
            raise ModelError("metadata 'tokenizer.ggml.token_type' must be an integer array")
        bos = _token_id(metadata, "tokenizer.ggml.bos_token_id", n)
        eos = _token_id(metadata, "tokenizer.ggml.eos_token_id", n)
        unk = _token_id(metadata, "tokenizer.ggml.unknown_token_id", n)
        extra = [
            i
            for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if (i := _token_id(metadata, k, n)) is not None
        ]
        if model == "gpt2":
            hf = _byte_level_bpe(metadata, tokens)
            default_bos, space_prefix = False, False
        elif model == "llama":
            space_prefix = _flag(metadata, "tokenizer.ggml.add_space_prefix", True)
            hf = _sentencepiece_bpe(metadata, tokens, unk, space_prefix)
            default_bos = True
        else:
            raise ModelError(
                f"unsupported tokenizer model {model!r} (tokenizer.ggml.model; supported: "
                "gpt2, llama)"
            )
        specials = [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and tokens[i]
        ]
        hf.add_special_tokens(specials)
        return cls(
            hf,
            tokens,
            types,  # checked above to hold ints: shared with the metadata, not copied
            model,
            bos,
            eos,
            _flag(metadata, "tokenizer.ggml.add_bos_token", default_bos) and bos is not None,
            _flag(metadata, "tokenizer.ggml.add_eos_token", False) and eos is not None,
            space_prefix,
            extra,
        )

    # ---- encoding
    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; special-token text (``<|im_start|>``) always parses as one id.

        ``add_special`` adds BOS/EOS as the model's metadata asks (BOS is not doubled when
        the text already starts with it, as rendered chat templates often do).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_special:
            if self.add_bos and (not ids or ids[0] != self.bos_id):
                ids.insert(0, self.bos_id)  # type: ignore[arg-type]
            if self.add_eos:
                ids.append(self.eos_id)  # type: ignore[arg-type]
        return ids

    # ---- decoding
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its text)."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        if not 0 <= token_id < len(self.tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary of {len(self.tokens)}")
        text = self.tokens[token_id]
        kind = self.token_types[token_id]
        if token_id in self.special_ids:
            out = text.encode("utf-8")
        elif self.model == "gpt2":
            table = _byte_decoder()
            try:
                out = bytes(table[c] for c in text)
            except KeyError:  # not in the byte alphabet: take the text as it is
                out = text.encode("utf-8")
        elif kind == TOKEN_BYTE and len(text) == 6 and text.startswith("<0x"):
            out = bytes([int(text[3:5], 16)])
        elif kind in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_UNUSED):
            out = b""
        else:
            out = text.replace(_SPM_SPACE, " ").encode("utf-8")
        self._bytes_cache[token_id] = out
        return out

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; incomplete UTF-8 at the end becomes U+FFFD."""
        parts = []
        first_text = True
        for i in ids:
            if i in self.special_ids:
                if not skip_special:
                    parts.append(self.token_bytes(i))
                continue
            piece = self.token_bytes(i)
            # SentencePiece: drop the space that encode() prefixed to the text.
            if first_text and self.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
            first_text = False
            parts.append(piece)
        return b"".join(parts).decode("utf-8", errors="replace")

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for: a text of ``n`` bytes has at least
        ``n / max_token_bytes`` tokens (special tokens count with their text)."""
        longest = 1
        for i, text in enumerate(self.tokens):
            longest = max(longest, len(self.token_bytes(i)), len(text.encode("utf-8")))
        return longest

    def incremental_decoder(self, skip_special: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special=skip_special)

    def id_of(self, text: str) -> int | None:
        """The id of the token whose text is exactly ``text``, if any."""
        return self.hf.token_to_id(text)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.model}, {len(self.tokens)} tokens, bos={self.bos_id}, "
            f"eos={self.eos_id}, stop={sorted(self.stop_ids)})"
        )


class IncrementalDecoder:
    """Turns a stream of token ids into text, never splitting a UTF-8 character.

    ``step(id)`` returns the text completed by that token (possibly ""); bytes of a partial
    multi-byte character are held back until the rest arrives. ``flush()`` returns what is
    left (an incomplete character becomes U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        if self.skip_special and token_id in self.tokenizer.special_ids:
            return ""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# --------------------------------------------------------------------------- builders


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str]) -> HFTokenizer:
    merges_raw = _as_list(metadata, "tokenizer.ggml.merges")
    assert merges_raw is not None
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for k, m in enumerate(merges_raw):
        parts = m.split(" ") if isinstance(m, str) else []
        if len(parts) != 2:
            raise ModelError(f"tokenizer.ggml.merges[{k}] = {m!r} is not 'left right'")
        merges.append((parts[0], parts[1]))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str):
        raise ModelError(f"metadata 'tokenizer.ggml.pre' must be a string, got {pre!r}"[:200])
    patterns = PRE_TOKENIZER_PATTERNS.get(pre, PRE_TOKENIZER_PATTERNS["default"])
    try:
        # llama.cpp (and HF) take a whole pre-token that is in the vocabulary for Llama 3.
        bpe = models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES)
    except Exception as e:
        raise ModelError(f"cannot build the BPE tokenizer from the GGUF: {e}") from e
    hf = HFTokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.decoder = decoders.ByteLevel()
    return hf


def _sentencepiece_bpe(
    metadata: Mapping[str, Any], tokens: list[str], unk: int | None, space_prefix: bool
) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges_raw = _as_list(metadata, "tokenizer.ggml.merges", required=False)
    if merges_raw is not None:
        if not all(isinstance(m, str) and " " in m for m in merges_raw):
            raise ModelError("metadata 'tokenizer.ggml.merges' must hold strings 'left right'")
        merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    else:
        scores = _as_list(metadata, "tokenizer.ggml.scores")
        assert scores is not None
        if len(scores) != len(tokens):
            raise ModelError(
                f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
            )
        if not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores):
            raise ModelError("metadata 'tokenizer.ggml.scores' must be a number array")
        if not all(math.isfinite(s) for s in scores):
            raise ModelError("metadata 'tokenizer.ggml.scores' must hold finite numbers")
        merges = _merges_from_scores(tokens, [float(s) for s in scores], vocab)
    try:
        bpe = models.BPE(
            vocab,
            merges,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    except Exception as e:
        raise ModelError(f"cannot build the SentencePiece tokenizer from the GGUF: {e}") from e
    hf = HFTokenizer(bpe)
    steps = [normalizers.Replace(" ", _SPM_SPACE)]
    if space_prefix:
        steps.insert(0, normalizers.Prepend(_SPM_SPACE))
    hf.normalizer = normalizers.Sequence(steps)
    hf.decoder = decoders.Sequence(
        [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return hf


def _merges_from_scores(
    tokens: list[str], scores: list[float], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """SentencePiece merges: every split of a token into two tokens, best merged score first.

    Tokens longer than ``MAX_SPLIT_CHARS`` are not split (no real vocabulary has one; the
    splits of a hostile long token would cost its length squared)."""
    found: list[tuple[float, int, int, str, str]] = []
    for piece, pid in vocab.items():
        if len(piece) > MAX_SPLIT_CHARS:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            lid, rid = vocab.get(left), vocab.get(right)
            if lid is not None and rid is not None:
                found.append((-scores[pid], lid, rid, left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]
