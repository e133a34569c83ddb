"""InternVL2.5-8B's `llm_config` (InternLM2) read as the Llama decoder transformers' conversion makes of it: its
shape, RoPE base and the end-of-turn id its generation_config.json adds; RoPE scalings that change positions below
`max_position_embeddings` (which caps a request) and attention biases are refused at load, not served wrongly."""

import json

import pytest

from language.models.internvl import InternVLChatForCausalLM
from mmserve.testing.checkpoints import internvl
from mmserve.testing.checkpoints.internvl_chat import internvl_chat_config
from mmserve.testing.checkpoints.internvl_internlm2 import llm_config, text_config


def _config(**llm_fields) -> dict:
    text = text_config("8b")
    hf = {"text_config": text, "vision_config": internvl.SHAPES["8b"]["vision"], "torch_dtype": "bfloat16"}
    return {**internvl_chat_config(hf, "8b"), "llm_config": {**llm_config(text), **llm_fields}}


def test_the_8b_llm_config_is_llamas_shape(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 92542}))
    cfg = InternVLChatForCausalLM.lm_config(str(tmp_path), _config())
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4096, 32, 32, 8, 128)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rms_norm_eps) == (14336, 92553, 1e-5)
    assert (cfg.rope_theta, cfg.max_position, cfg.qkv_bias) == (1e6, 32768, False)
    assert cfg.eos_token_ids == (2, 92542)  # </s> from llm_config, <|im_end|> from generation_config.json


@pytest.mark.parametrize(
    "fields, refusal",
    [({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear' RoPE scaling"), ({"bias": True}, "biases")],
)
def test_what_would_be_served_wrongly_is_refused(tmp_path, fields, refusal):
    with pytest.raises(ValueError, match=refusal):
        InternVLChatForCausalLM.lm_config(str(tmp_path), _config(**fields))
