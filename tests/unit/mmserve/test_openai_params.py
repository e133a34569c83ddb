"""OpenAI's n and logprobs fields -> what the server runs: n reaches SamplingParams (validated, fanned out as
/generate's n); logprobs true / top_logprobs k (chat) and logprobs k (completions) ask for each chosen token's own
logprob and k alternatives (top_logprobs in SamplingParams); echo with logprobs scores the prompt too."""

from __future__ import annotations

import pytest

from mmserve.http.openai_protocol import completion_input, logprobs_request, sampling_params
from mmserve.http.protocol import BadRequest


def test_n_reaches_the_sampling_params():
    assert sampling_params({"n": 3}, 16).num_sequences == 3
    assert sampling_params({}, 16).num_sequences == 1
    for bad in (0, 17, "2", True):
        with pytest.raises(BadRequest) as info:
            sampling_params({"n": bad}, 16)
        assert info.value.field == "n"


@pytest.mark.parametrize(
    "body, chat, wanted",
    [({}, True, None), ({"logprobs": False}, True, None), ({"logprobs": True}, True, 0),
     ({"logprobs": True, "top_logprobs": 0}, True, 0), ({"logprobs": True, "top_logprobs": 20}, True, 20),
     ({}, False, None), ({"logprobs": 0}, False, 0), ({"logprobs": 5}, False, 5)],
)  # fmt: skip
def test_logprobs_and_their_alternatives_are_accepted(body, chat, wanted):
    assert logprobs_request(body, chat) == wanted


@pytest.mark.parametrize(
    "body, chat, field, words",
    [({"top_logprobs": 0}, True, "top_logprobs", "requires logprobs"),
     ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs", "[0, 20]"),
     ({"logprobs": True, "top_logprobs": True}, True, "top_logprobs", "[0, 20]"),
     ({"logprobs": 1}, True, "logprobs", "boolean"),
     ({"logprobs": 6}, False, "logprobs", "[0, 5]"),
     ({"logprobs": True}, False, "logprobs", "integer"),
     ({"top_logprobs": 1}, False, "top_logprobs", "chat field")],
)  # fmt: skip
def test_malformed_logprobs_are_refused_by_name(body, chat, field, words):
    with pytest.raises(BadRequest) as info:
        logprobs_request(body, chat)
    assert info.value.field == field and words in info.value.message


def test_completion_input_carries_logprobs_and_echo():
    params = completion_input({"prompt": "Hi", "logprobs": 3, "n": 2}, 100).params
    assert (params.n, params.top_logprobs, params.prompt_logprobs) == (2, 3, None)
    echoed = completion_input({"prompt": "Hi", "logprobs": 2, "echo": True}, 100).params
    assert (echoed.top_logprobs, echoed.prompt_logprobs) == (2, 2)
    assert completion_input({"prompt": "Hi", "echo": True}, 100).params.prompt_logprobs is None  # text only
    with pytest.raises(BadRequest) as info:
        completion_input({"prompt": "Hi", "echo": "yes"}, 100)
    assert info.value.field == "echo"
