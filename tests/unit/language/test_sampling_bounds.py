"""SamplingParams.validate admits only what the engine's dtypes hold (int64 / int32 ids, float32 factors), so no
request can overflow a tensor conversion or turn the logits into inf/NaN."""

from __future__ import annotations

import pytest

from language.sampling_params import (
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_TOKEN_LIST,
    InvalidParams,
    SamplingParams,
)

INT32_MAX = 2**31 - 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**64),
        ("top_k", INT32_MAX + 1),
        ("repetition_penalty", 5e-324),  # 0.0 in float32: logit / penalty is inf
        ("repetition_penalty", 1e-3),
        ("top_p", 5e-324),  # 0.0 in float32: every token would be cut
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("stop_token_ids", (INT32_MAX + 1,)),
        ("allowed_token_ids", (2**64,)),
        ("logit_bias", ((2**40, 1.0),)),
        ("exponential_decay_length_penalty", (0, 1e308)),
        ("exponential_decay_length_penalty", (0, 10.5)),
        ("exponential_decay_length_penalty", (2**63, 1.5)),
        ("stop_token_ids", (7,) * (MAX_TOKEN_LIST + 1)),  # a 64 MiB body holds ~20 M
        ("allowed_token_ids", (7,) * (MAX_TOKEN_LIST + 1)),
        ("stop_sequences", ("x",) * (MAX_STOP_SEQUENCES + 1)),  # each is searched in every new piece of text
        ("stop_sequences", ("x" * (MAX_STOP_CHARS + 1),)),
    ],
    ids=lambda v: f"{len(v)} items" if isinstance(v, tuple) and len(v) > 8 else None,
)
def test_values_the_engine_cannot_hold_are_refused(field, value):
    with pytest.raises(InvalidParams) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.field == field


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", INT32_MAX),  # above the vocabulary: no cut
        ("top_k", -1),
        ("repetition_penalty", 0.01),
        ("repetition_penalty", 10.0),
        ("top_p", 1e-8),
        ("min_p", 1.0),  # the most likely ids alone
        ("min_p", 5e-324),  # log(min_p) = -744: no cut in float32
        ("stop_token_ids", (INT32_MAX,)),
        ("allowed_token_ids", (0, INT32_MAX)),
        ("exponential_decay_length_penalty", (0, 1.5)),
        ("exponential_decay_length_penalty", (INT32_MAX, 10.0)),
        ("seed", 2**63 - 1),
        ("stop_token_ids", (7,) * MAX_TOKEN_LIST),
        ("stop_sequences", ("x" * MAX_STOP_CHARS,) * MAX_STOP_SEQUENCES),
    ],
    ids=lambda v: f"{len(v)} items" if isinstance(v, tuple) and len(v) > 8 else None,
)
def test_values_at_the_bounds_are_admitted(field, value):
    SamplingParams(**{field: value}).validate()


def test_a_tiny_temperature_samples_greedily():
    """float32 has no room for logits / 1e-300: such a temperature is greedy (as vLLM's below 1e-5)."""
    assert SamplingParams(do_sample=True, temperature=1e-300).validate().greedy
    assert not SamplingParams(do_sample=True, temperature=0.05).validate().greedy
