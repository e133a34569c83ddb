"""OpenAI's n and logprobs fields -> what the server runs: n reaches SamplingParams (validated, fanned out as
/generate's n), logprobs true / 0 ask for each chosen token's own logprob, top-k logprobs get a 400 naming the field."""

from __future__ import annotations

import pytest

from mmserve.openai_protocol import completion_input, sampling_params, wants_logprobs
from mmserve.protocol import BadRequest


def test_n_reaches_the_sampling_params():
    assert sampling_params({"n": 3}, 16).num_sequences == 3
    assert sampling_params({}, 16).num_sequences == 1
    for bad in (0, 17, "2", True):
        with pytest.raises(BadRequest) as info:
            sampling_params({"n": bad}, 16)
        assert info.value.field == "n"


@pytest.mark.parametrize(
    "body, chat, wanted",
    [({}, True, False), ({"logprobs": False}, True, False), ({"logprobs": True}, True, True),
     ({"logprobs": True, "top_logprobs": 0}, True, True), ({}, False, False), ({"logprobs": 0}, False, True)],
)  # fmt: skip
def test_own_logprobs_are_accepted(body, chat, wanted):
    assert wants_logprobs(body, chat) is wanted


@pytest.mark.parametrize(
    "body, chat, field, words",
    [({"logprobs": True, "top_logprobs": 5}, True, "top_logprobs", "not supported yet"),
     ({"top_logprobs": 0}, True, "top_logprobs", "requires logprobs"),
     ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs", "[0, 20]"),
     ({"logprobs": 1}, True, "logprobs", "boolean"),
     ({"logprobs": 2}, False, "logprobs", "not supported yet"),
     ({"logprobs": True}, False, "logprobs", "integer"),
     ({"top_logprobs": 1}, False, "top_logprobs", "chat field")],
)  # fmt: skip
def test_top_k_and_malformed_logprobs_are_refused_by_name(body, chat, field, words):
    with pytest.raises(BadRequest) as info:
        wants_logprobs(body, chat)
    assert info.value.field == field and words in info.value.message


def test_completion_input_checks_logprobs():
    assert completion_input({"prompt": "Hi", "logprobs": 0, "n": 2}, 100).params.n == 2
    with pytest.raises(BadRequest):
        completion_input({"prompt": "Hi", "logprobs": 3}, 100)
