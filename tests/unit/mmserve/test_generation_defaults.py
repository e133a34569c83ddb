"""The OpenAI routes' default sampling from the model's generation config (vLLM's --generation-config)."""

import pytest
from transformers import GenerationConfig

from mmserve.http.generation_defaults import sampling_defaults
from mmserve.http.openai_protocol import sampling_params

QWEN3_VL = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_new_tokens=64)


def _folder(tmp_path, **fields) -> str:
    GenerationConfig(bos_token_id=1, eos_token_id=2, **fields).save_pretrained(tmp_path)
    return str(tmp_path)


def test_the_checkpoints_sampling_fields_become_defaults(tmp_path) -> None:
    folder = _folder(tmp_path, **QWEN3_VL)
    expected = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 64}
    assert sampling_defaults("auto", folder) == expected
    assert sampling_defaults("vllm", folder) == {}
    assert sampling_defaults(folder, None) == expected  # a folder of its own


def test_no_file_no_defaults_and_a_named_folder_must_hold_one(tmp_path) -> None:
    assert sampling_defaults("auto", str(tmp_path)) == {}
    assert sampling_defaults("auto", _folder(tmp_path)) == {}  # only ids: transformers' defaults otherwise
    with pytest.raises(ValueError, match="generation_config.json"):
        sampling_defaults(str(tmp_path / "elsewhere"), None)


def test_overrides_set_fields_over_any_source(tmp_path) -> None:
    """vLLM's --override-generation-config: generation-config names, over the checkpoint's file or none."""
    folder = _folder(tmp_path, **QWEN3_VL)
    overrides = {"temperature": 0.3, "max_new_tokens": 9, "min_p": 0.05}
    got = sampling_defaults("auto", folder, overrides)
    assert got == {"temperature": 0.3, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 9,
                   "min_p": 0.05}  # fmt: skip
    assert sampling_defaults("vllm", folder, {"top_k": 5}) == {"top_k": 5}


def test_a_file_that_is_not_json_gives_no_defaults(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults("auto", str(tmp_path)) == {}


def test_a_value_the_server_refuses_is_left_out(tmp_path) -> None:
    folder = _folder(tmp_path, do_sample=True, temperature=0.6, repetition_penalty=50.0)
    assert sampling_defaults("auto", folder) == {"temperature": 0.6}


def test_a_request_sets_what_it_names_and_takes_the_rest() -> None:
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 64}
    unset = sampling_params({}, 1000, defaults)
    assert (unset.do_sample, unset.temperature, unset.top_p, unset.top_k) == (True, 0.7, 0.8, 20)
    assert (unset.repetition_penalty, unset.max_new_tokens) == (1.05, 64)
    greedy = sampling_params({"temperature": 0, "top_k": None, "max_completion_tokens": 9}, 1000, defaults)
    assert (greedy.do_sample, greedy.top_k, greedy.max_new_tokens) == (False, 20, 9)  # null: unset, as vLLM
    plain = sampling_params({}, 1000)
    assert (plain.do_sample, plain.temperature, plain.top_k, plain.max_new_tokens) == (True, 1.0, -1, 1000)
