"""Sampling parameters of one request, in the style of vLLM's ``SamplingParams``.

Differences from vLLM worth knowing: ``max_tokens`` defaults to 256 (vLLM: 16), and
``seed=None`` draws a fresh seed per request (so two unseeded requests differ).
"""

from __future__ import annotations

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

#: Largest seed the device sampler takes (seeds are uint32, see ``SAMPLE_PARAMS_DTYPE``).
MAX_SEED = 2**32 - 1
#: Largest ``top_k`` the device sampler takes (an int32 in ``SAMPLE_PARAMS_DTYPE``).
MAX_TOP_K = 2**31 - 1
#: The smallest positive ``top_p`` the sampler sees as positive: the smallest normal
#: float32 (a smaller value rounds to 0, or to a denormal a GPU may flush to 0).
MIN_TOP_P = float(np.finfo(np.float32).tiny)
#: Below this a temperature is greedy (as in vLLM): dividing logits by a smaller one
#: overflows float32 and would turn the probabilities into NaN.
MIN_TEMPERATURE = 1e-5
#: The most alternatives ``logprobs`` may ask for (OpenAI's ``top_logprobs`` limit).
MAX_LOGPROBS = 20
#: The largest temperature float32 holds (``logits / temperature`` runs in float32).
MAX_TEMPERATURE = float(np.finfo(np.float32).max)


class SamplingParams(BaseModel):
    """How to sample one request's tokens and when to stop.

    ``temperature == 0`` is greedy (so is anything below ``MIN_TEMPERATURE``, 1e-5);
    ``top_k == 0`` (or -1) and ``top_p == 1`` turn those filters off. Values are checked in
    the units the device sampler uses (float32 temperature and ``top_p``, int32 ``top_k``,
    uint32 seed), so a value that passes cannot fail a step. Generation stops at the
    model's end-of-turn tokens (unless ``ignore_eos``), any of ``stop_token_ids``, any of
    the ``stop`` strings (trimmed from the text), after ``max_tokens`` tokens, or when the
    sequence reaches the engine's ``max_model_len``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int | None = Field(
        default=256, description="most tokens to generate; None: until a stop or max_model_len"
    )
    temperature: float = Field(default=1.0, description="0 is greedy")
    top_k: int = Field(default=0, description="keep the k most likely tokens; 0 or -1: all")
    top_p: float = Field(default=1.0, description="nucleus sampling mass in (0, 1]")
    seed: int | None = Field(default=None, description=f"0..{MAX_SEED}; None: random")
    stop: list[str] = Field(default_factory=list, description="strings that end generation")
    stop_token_ids: list[int] = Field(default_factory=list, description="ids that end it")
    ignore_eos: bool = Field(default=False, description="keep going past end-of-turn tokens")
    logprobs: int | None = Field(
        default=None,
        description=f"report each token's logprob and this many alternatives (0..{MAX_LOGPROBS})",
    )
    prompt_logprobs: int | None = Field(
        default=None,
        description="report each prompt token's logprob (after the first) and this many "
        f"alternatives (0..{MAX_LOGPROBS}); the prompt is then prefilled a few rows a step",
    )

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_tokens must be at least 1, got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not v >= 0.0 or v == float("inf"):  # also refuses NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {v}")
        if v > MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be at most {MAX_TEMPERATURE:.4g} (float32), got {v}"
            )
        return 0.0 if v < MIN_TEMPERATURE else v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"top_k must be >= 0 (0 or -1 disables it), got {v}")
        if v > MAX_TOP_K:
            raise ValueError(f"top_k must be at most {MAX_TOP_K} (int32), got {v}")
        return max(v, 0)

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        if v < MIN_TOP_P:
            raise ValueError(
                f"top_p must be in (0, 1], got {v}, which is 0 in float32 (the sampler's "
                f"precision); the smallest is {MIN_TOP_P:.4g}"
            )
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_SEED:
            raise ValueError(f"seed must be between 0 and {MAX_SEED}, got {v}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: object) -> object:
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if isinstance(v, (list, tuple)) and any(isinstance(s, str) and s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"{info.field_name} must be between 0 and {MAX_LOGPROBS}, got {v}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        bad = [i for i in v if i < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be >= 0, got {bad}")
        return v


def describe_validation_error(err: ValidationError) -> str:
    """One line naming each bad field and why, for CLI and API error messages."""
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e.get("loc", ())) or "value"
        msg = str(e.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = "unknown sampling parameter"
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)
