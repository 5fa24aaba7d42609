"""SamplingParams: defaults, normalisation and a clear error for every bad value."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from vt.frontends.sampling import MAX_SEED, SamplingParams, describe_validation_error


def test_defaults() -> None:
    p = SamplingParams()
    assert p.max_tokens == 256
    assert (p.temperature, p.top_k, p.top_p) == (1.0, 0, 1.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos


def test_normalisation() -> None:
    p = SamplingParams(stop="\n\n", top_k=-1, max_tokens=None, seed=MAX_SEED)
    assert p.stop == ["\n\n"]
    assert p.top_k == 0  # vLLM's "-1 disables top-k" is accepted
    assert p.max_tokens is None
    assert SamplingParams(stop=None).stop == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0, got -0.1"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be >= 0 (0 or -1 disables it), got -2"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"seed": -1}, f"seed must be between 0 and {MAX_SEED}, got -1"),
        ({"seed": MAX_SEED + 1}, f"seed must be between 0 and {MAX_SEED}"),
        ({"stop": ["ok", ""]}, "stop strings must not be empty"),
        ({"stop_token_ids": [3, -4]}, "stop_token_ids must be >= 0, got [-4]"),
        ({"temprature": 0.5}, "temprature: unknown sampling parameter"),
        ({"max_tokens": "many"}, "max_tokens:"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    line = describe_validation_error(info.value)
    assert message in line
    assert "\n" not in line
    assert line.startswith(next(iter(kwargs)))


def test_is_a_value_error_and_frozen() -> None:
    with pytest.raises(ValueError):
        SamplingParams(top_p=2)
    p = SamplingParams()
    with pytest.raises(ValidationError):
        p.temperature = 0.5  # type: ignore[misc]
    assert p.model_copy(update={"temperature": 0.5}).temperature == 0.5
