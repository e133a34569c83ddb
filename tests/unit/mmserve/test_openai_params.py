"""OpenAI's n and logprobs fields -> what the server runs: n reaches SamplingParams (validated, fanned out as
/generate's n); logprobs true / top_logprobs k (chat) and logprobs k (completions) ask for each chosen token's own
logprob and k alternatives (top_logprobs in SamplingParams); echo with logprobs scores the prompt too."""

from __future__ import annotations

import pytest

from mmserve.http.openai_protocol import completion_inputs, logprobs_request, sampling_params
from mmserve.http.protocol import BadRequest
from mmserve.testing.checkpoints.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


def completion_input(body: dict, default_max: int, tokenizer):
    (one,) = completion_inputs(body, default_max, tokenizer)
    return one


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


def test_completion_input_carries_logprobs_and_echo(tokenizer):
    params = completion_input({"prompt": "Hi", "logprobs": 3, "n": 2}, 100, tokenizer).params
    assert (params.n, params.top_logprobs, params.prompt_logprobs) == (2, 3, None)
    echoed = completion_input({"prompt": "Hi", "logprobs": 2, "echo": True}, 100, tokenizer).params
    assert (echoed.top_logprobs, echoed.prompt_logprobs) == (2, 2)
    assert completion_input({"prompt": "Hi", "echo": True}, 100, tokenizer).params.prompt_logprobs is None  # text only
    with pytest.raises(BadRequest) as info:
        completion_input({"prompt": "Hi", "echo": "yes"}, 100, tokenizer)
    assert info.value.field == "echo"


def test_completion_prompts_each_become_an_input_in_order(tokenizer):
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    for prompt, texts in [
        ("Hi", ["Hi"]),
        (["Hi", "Ho"], ["Hi", "Ho"]),
        (ids, ["Hello there"]),
        ([ids, "Ho", ids[:1]], ["Hello there", "Ho", tokenizer.decode(ids[:1])]),
    ]:
        inputs = completion_inputs({"prompt": prompt}, 100, tokenizer)
        assert [i.prompt for i in inputs] == texts
    token_inputs = completion_inputs({"prompt": [ids, ids[:1]]}, 100, tokenizer)
    assert [i.prompt_ids for i in token_inputs] == [tuple(ids), tuple(ids[:1])]


@pytest.mark.parametrize(
    "prompt, words",
    [([], "must be"), ("", "must be"), ([[]], "must be"), (["Hi", ""], "prompt 1: must be"), ([1, "a"], "prompt 0"),
     ([1, 2, 100000], "[100000] are out of the vocabulary (size 512)"), ([[1], [-1]], "prompt 1: token ids [-1]"),
     (None, "must be"), ([True], "must be"), ([True, 3], "prompt 0")],
)  # fmt: skip
def test_malformed_completion_prompts_are_refused_by_name(tokenizer, prompt, words):
    with pytest.raises(BadRequest) as info:
        completion_inputs({"prompt": prompt}, 100, tokenizer)
    assert info.value.field == "prompt" and words in info.value.message


@pytest.mark.parametrize(
    "body, field, value",
    [({"logit_bias": {"7": 5, "3": -1.5}}, "logit_bias", ((3, -1.5), (7, 5))),
     ({"stop_token_ids": [5, 9]}, "stop_token_ids", (5, 9)),
     ({"min_tokens": 4}, "min_new_tokens", 4),
     ({"allowed_token_ids": [9, 5, 9]}, "allowed_token_ids", (5, 9)),
     ({"prompt_logprobs": 2}, "prompt_logprobs", 2),
     ({"best_of": 3, "n": 2}, "best_of", 3),
     ({"do_sample": False, "temperature": 1.0}, "do_sample", False),
     ({"skip_special_tokens": False}, "skip_special_tokens", False),
     ({"spaces_between_special_tokens": False}, "add_spaces_between_special_tokens", False)],
)  # fmt: skip
def test_vllm_extras_reach_the_sampling_params(body, field, value):
    assert getattr(sampling_params(body, 16), field) == value


@pytest.mark.parametrize(
    "body, field, words",
    [({"logit_bias": {"7": 101}}, "logit_bias", "[-100, 100]"),
     ({"logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
     ({"logit_bias": [1]}, "logit_bias", "must be an object"),
     ({"min_tokens": 9, "max_tokens": 4}, "min_new_tokens", "must not exceed"),
     ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
     ({"stop_token_ids": "5"}, "stop_token_ids", "list of token ids"),
     ({"best_of": 1, "n": 2}, "best_of", ">= n"),
     ({"best_of": 3, "stream": True}, "best_of", "stream"),
     ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
     ({"prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]")],
)  # fmt: skip
def test_malformed_extras_are_refused_by_name(body, field, words):
    with pytest.raises(BadRequest) as info:
        sampling_params(body, 16)
    assert info.value.field == field and words in info.value.message
