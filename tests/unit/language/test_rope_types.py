"""A decoder that applies plain RoPE (or M-RoPE) refuses, at load, a config whose RoPE type moves the angles at any
position (linear, yarn, llama3...), rather than serving it with the wrong ones; the types it computes exactly load."""

import pytest
import torch

from language.models.llama import LlamaForCausalLM
from language.models.qwen2_vl import Qwen2VLForCausalLM
from mmserve.testing.checkpoints.llama import llama_config
from mmserve.testing.checkpoints.qwen2_vl import qwen2_vl_config

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 1024},
    ],
    ids=lambda s: s["rope_type"],
)  # fmt: skip
def test_a_rope_type_that_moves_the_angles_is_refused(tmp_path, scaling):
    raw = llama_config(512, **SHAPE, rope_scaling=scaling)
    with pytest.raises(ValueError, match=f"'{scaling['rope_type']}' RoPE scaling is not served for LlamaForCausalLM"):
        LlamaForCausalLM.lm_config(str(tmp_path), raw)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "default"}, {"rope_type": "dynamic", "factor": 2.0}])
def test_plain_rope_types_load(tmp_path, scaling):
    cfg = LlamaForCausalLM.lm_config(str(tmp_path), llama_config(512, **SHAPE, rope_scaling=scaling))
    assert (cfg.rope_theta, cfg.max_position) == (10000.0, 4096)


def test_m_rope_loads(tmp_path):
    cfg = Qwen2VLForCausalLM.lm_config(str(tmp_path), qwen2_vl_config("tiny", torch.float32))
    assert cfg.mrope_section is not None
