"""LightLLM's whole /generate parameter set: every name is accepted, values are validated with a 400 naming the
field, and names LightLLM does not have are still refused."""

from __future__ import annotations

import json

import pytest

from mmserve.http.protocol import BadRequest, parse_generate_body


def params(**parameters):
    return parse_generate_body(json.dumps({"inputs": "x", "parameters": parameters}).encode()).params


def bad(**parameters) -> str:
    with pytest.raises(BadRequest) as e:
        params(**parameters)
    assert e.value.status == 400
    return e.value.field


LIGHTLLM_PARAMETERS = {
    "best_of": 2,
    "n": 2,
    "do_sample": True,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.1,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": -1,
    "ignore_eos": False,
    "image_max_patch_num": -1,
    "max_new_tokens": 8,
    "min_new_tokens": 2,
    "input_penalty": False,
    "group_request_id": 7,
    "skip_special_tokens": False,
    "disable_prompt_cache": True,
    "add_special_tokens": False,
    "add_spaces_between_special_tokens": False,
    "print_eos_token": True,
    "seed": 3,
    "prompt_logprobs": None,
    "exponential_decay_length_penalty": [4, 1.2],
    "stop_sequences": ["\n"],
    "allowed_token_ids": [5, 3, 5],
    "logit_bias": {"7": 2.5, "9": -100},
}


def test_every_lightllm_parameter_is_accepted():
    p = params(**LIGHTLLM_PARAMETERS)
    assert (p.n, p.best_of, p.min_new_tokens, p.num_sequences) == (2, 2, 2, 2)
    assert p.allowed_token_ids == (3, 5)
    assert p.logit_bias == ((7, 2.5), (9, -100))
    assert p.exponential_decay_length_penalty == (4, 1.2)
    assert p.skip_special_tokens is False and p.add_spaces_between_special_tokens is False
    assert p.print_eos_token is True and p.add_special_tokens is False
    assert p.has_logit_masks


def test_defaults_keep_todays_behaviour():
    p = params()
    assert (p.n, p.best_of, p.num_sequences, p.min_new_tokens) == (1, None, 1, 0)
    assert p.skip_special_tokens and p.add_spaces_between_special_tokens and not p.print_eos_token
    assert p.add_special_tokens is None and p.allowed_token_ids is None and p.logit_bias == ()
    assert not p.has_logit_masks


@pytest.mark.parametrize(
    "name, value, kind",
    [("guided_json", {"type": "object"}, "json"), ("regular_constraint", "a+", "regex"),
     ("guided_grammar", 'root ::= "a"', "grammar"), ("guided_grammar", "json", "json_object")],
)  # fmt: skip
def test_lightllm_constraint_parameters_constrain_the_output(name, value, kind):
    assert params(**{name: value}).structured.kind == kind
    for absent in (None, False, ""):  # null, and LightLLM's own default "", mean "not asked for"
        assert params(**{name: absent}).structured is None


@pytest.mark.parametrize("value, expected", [(None, None), (False, None), (True, 0), (0, 0), (3, 3), (20, 20)])
def test_prompt_logprobs_take_a_boolean_or_a_count(value, expected):
    assert params(prompt_logprobs=value).prompt_logprobs == expected


@pytest.mark.parametrize("value", [-1, 21, "1", 1.5, [1]])
def test_bad_prompt_logprobs_are_refused_by_name(value):
    with pytest.raises(BadRequest) as e:
        params(prompt_logprobs=value)
    assert e.value.field == "parameters.prompt_logprobs" and "[0, 20]" in e.value.message


@pytest.mark.parametrize("name", ["skip_special_token", "max_tokens", "guided_regex", "logprobs", "top_logprobs"])
def test_names_lightllm_lacks_are_still_refused(name):
    with pytest.raises(BadRequest) as e:
        params(**{name: 1})
    assert e.value.field == f"parameters.{name}" and "unknown" in e.value.message


@pytest.mark.parametrize(
    "parameters,field",
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 0}, "best_of"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"logit_bias": {"3": "x"}}, "logit_bias"),
        ({"exponential_decay_length_penalty": [1]}, "exponential_decay_length_penalty"),
        ({"exponential_decay_length_penalty": [1, 0.5]}, "exponential_decay_length_penalty"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
        ({"add_special_tokens": "yes"}, "add_special_tokens"),
        ({"add_spaces_between_special_tokens": 0}, "add_spaces_between_special_tokens"),
        ({"print_eos_token": "true"}, "print_eos_token"),
        ({"input_penalty": 1}, "input_penalty"),
        ({"image_max_patch_num": -2}, "image_max_patch_num"),
        ({"image_max_patch_num": 65}, "image_max_patch_num"),
        ({"image_max_patch_num": 1.5}, "image_max_patch_num"),
        ({"group_request_id": "g"}, "group_request_id"),
    ],
)
def test_bad_values_name_their_field(parameters, field):
    assert bad(**parameters) == f"parameters.{field}"


@pytest.mark.parametrize("value,expected", [(None, -1), (-1, -1), (0, 0), (6, 6), (64, 64)])
def test_image_max_patch_num_travels_with_the_request_not_the_sampling(value, expected):
    body = {"inputs": "x", "parameters": {"max_new_tokens": 2, "image_max_patch_num": value}}
    req = parse_generate_body(json.dumps(body).encode())
    assert req.image_max_patch_num == expected and req.params.max_new_tokens == 2
