"""Request JSON parsing and validation (LightLLM's shapes), and the response shapes."""

from __future__ import annotations

import json

import pytest

from language.request import RequestError
from mmserve.http.openai_api import _request_error
from mmserve.http.protocol import BadRequest, generate_response, parse_generate_body
from mmserve.http.stream_events import StreamState, stream_events
from mmserve.ipc.messages import TextOutput, TokenDetail


def parse(body) -> object:
    return parse_generate_body(json.dumps(body).encode())


def test_lightllm_text_request():
    req = parse({"inputs": "What is AI?", "parameters": {"max_new_tokens": 17, "frequency_penalty": 1}})
    assert req.prompt == "What is AI?"
    assert req.params.max_new_tokens == 17 and req.params.frequency_penalty == 1
    assert req.params.greedy


def test_input_alias_and_defaults():
    req = parse({"input": "hi"})
    assert req.prompt == "hi" and req.params.max_new_tokens == 16 and req.multimodal_params == {}


def test_stop_sequences_string_or_list():
    assert parse({"inputs": "x", "parameters": {"stop_sequences": "<|im_end|>"}}).params.stop_sequences == (
        "<|im_end|>",
    )
    assert parse({"inputs": "x", "parameters": {"stop_sequences": ["a", "b"]}}).params.stop_sequences == ("a", "b")


@pytest.mark.parametrize(
    "body,field",
    [
        ([1, 2], "body"),
        ({}, "inputs"),
        ({"inputs": ""}, "inputs"),
        ({"inputs": 5}, "inputs"),
        ({"inputs": "x", "prompt": "y"}, "prompt"),
        ({"inputs": "x", "parameters": [1]}, "parameters"),
        ({"inputs": "x", "parameters": {"max_tokens": 3}}, "parameters.max_tokens"),
        ({"inputs": "x", "parameters": {"temperature": -1}}, "parameters.temperature"),
        ({"inputs": "x", "parameters": {"top_p": 0}}, "parameters.top_p"),
        ({"inputs": "x", "parameters": {"top_k": -3}}, "parameters.top_k"),
        ({"inputs": "x", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
        ({"inputs": "x", "parameters": {"max_new_tokens": "10"}}, "parameters.max_new_tokens"),
        ({"inputs": "x", "parameters": {"do_sample": "yes"}}, "parameters.do_sample"),
        ({"inputs": "x", "parameters": {"stop_sequences": [1]}}, "parameters.stop_sequences"),
        ({"inputs": "x", "parameters": {"stop_sequences": ""}}, "parameters.stop_sequences"),
        ({"inputs": "x", "parameters": {"repetition_penalty": 0}}, "parameters.repetition_penalty"),
        ({"inputs": "x", "parameters": {"seed": -1}}, "parameters.seed"),
        ({"inputs": "x", "parameters": {"return_details": 1}}, "parameters.return_details"),
        ({"inputs": "x", "multimodal_params": "img"}, "multimodal_params"),
    ],
)
def test_bad_requests_name_the_field(body, field):
    with pytest.raises(BadRequest) as e:
        parse(body)
    assert e.value.field == field
    assert e.value.to_json()["field"] == field and field in e.value.to_json()["error"]


def test_non_json_body():
    with pytest.raises(BadRequest) as e:
        parse_generate_body(b"inputs=hello")
    assert e.value.field == "body"


def test_response_shapes():
    """LightLLM's /generate answer and /generate_stream events (its api_lightllm.py), field by field."""
    tokens = [TokenDetail(5, "He", -0.5), TokenDetail(2, "llo", -1.0, special=True)]
    out = generate_response("Hello", tokens, "length", 3, 2, return_details=False, image_tokens=1)
    assert out == {
        "generated_text": ["Hello"],
        "count_output_tokens": 2,
        "finish_reason": "length",
        "prompt_tokens": 3,
        "logprobs": [
            {"5": {"logprob": -0.5, "rank": None, "decoded_token": "He"}},
            {"2": {"logprob": -1.0, "rank": None, "decoded_token": "llo"}},
        ],
        "input_usage": {"input_text_tokens": 2, "input_audio_tokens": 0, "input_image_tokens": 1},
    }
    out = generate_response("Hello", tokens, "length", 3, 2, return_details=True)
    assert out["tokens"] == [
        {"id": 5, "text": "He", "logprob": -0.5, "special": False, "count_output_tokens": 1, "prompt_tokens": 3},
        {"id": 2, "text": "llo", "logprob": -1.0, "special": True, "count_output_tokens": 2, "prompt_tokens": 3},
    ]
    state = StreamState()
    events = stream_events(TextOutput("r", "Hello", tokens, True, "length", 3, 2), state)
    assert len(events) == 2 and all(e.startswith("data:{") and e.endswith("}\n\n") for e in events)
    first, last = (json.loads(e[5:]) for e in events)
    assert first == {
        "token": {"id": 5, "text": "", "logprob": -0.5, "special": False, "count_output_tokens": 1,
                  "prompt_tokens": 3, "logprobs": {"5": {"logprob": -0.5, "rank": None, "decoded_token": "He"}}},
        "generated_text": None, "finished": False, "finish_reason": None, "details": None,
        "input_usage": {"input_text_tokens": 3, "input_audio_tokens": 0, "input_image_tokens": 0},
        "prompt_cache_len": 0,
    }  # fmt: skip
    assert last["token"]["text"] == "Hello" and last["token"]["special"] and last["token"]["count_output_tokens"] == 2
    assert last["finished"] and last["finish_reason"] == "length" and last["generated_text"] == "Hello"
    aborted = stream_events(TextOutput("r", "", [], True, "abort", 3, 2), state)  # an end without a token
    (end,) = (json.loads(e[5:]) for e in aborted)
    assert end["token"]["id"] is None and end["token"]["logprobs"] == {} and end["finish_reason"] == "abort"


@pytest.mark.parametrize(
    "error,status,body,openai",
    [
        (RequestError(400, "parameters.logit_bias", "token id out of the vocabulary (size 9)"), 400,
         {"error": "parameters.logit_bias: token id out of the vocabulary (size 9)", "field": "parameters.logit_bias"},
         ("logit_bias", "logit_bias: token id out of the vocabulary (size 9)")),
        (RequestError(400, "inputs", "image encoding failed: boom"), 400,
         {"error": "inputs: image encoding failed: boom", "field": "inputs"},
         ("prompt", "prompt: image encoding failed: boom")),
        (RequestError.server_failure("the step raised X"), 500,
         {"error": "server: the step raised X", "field": "server"}, (None, "the step raised X")),
    ],
)  # fmt: skip
def test_engine_errors_become_each_routes_body(error, status, body, openai):
    """A RequestError from the router or the engine, as /generate answers it and as /v1/completions does."""
    refusal = BadRequest.of(error)
    assert (refusal.status, refusal.to_json()) == (status, body)
    response = _request_error(error, {"prompt": "x"}, chat=False)
    reply = json.loads(response.body)["error"]
    assert response.status_code == status and (reply["param"], reply["message"]) == openai
    assert reply["type"] == ("server_error" if status == 500 else "invalid_request_error")
