"""--load_format dummy (vLLM's): the decoder and the Qwen2-VL tower come from config.json alone, no weight files;
and the 72B shape the GPU benchmark serves that way splits over 4 and 8 ranks."""

from __future__ import annotations

import os

import torch

from language.models.hf_config import lm_config_from_hf
from language.parallel.sharding import check_divisible, make_shard
from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl, qwen2_vl_config
from visual.models.qwen2_vl import Qwen2VLVisionModel


def test_dummy_weights_serve_from_config_alone(tmp_path):
    model_dir = build_qwen2_vl(str(tmp_path / "q2vl"), weights=False)
    assert not [f for f in os.listdir(model_dir) if f.endswith((".safetensors", ".bin"))]
    llm = LLM(model_dir, max_total_token_num=256, device="cpu", load_format="dummy")
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    tower = Qwen2VLVisionModel.from_pretrained(model_dir, torch.device("cpu"), torch.float32, dummy=True)
    assert tower.hidden_size == 64


def test_72b_shape_splits_over_4_and_8_ranks(tmp_path):
    lm = lm_config_from_hf(str(tmp_path), qwen2_vl_config("72b", torch.bfloat16), qkv_bias=True)
    assert (lm.hidden_size, lm.num_layers, lm.num_heads, lm.num_kv_heads) == (8192, 80, 64, 8)
    for tp in (4, 8):
        check_divisible(lm, tp)
        shard = make_shard(lm, tp - 1, tp)
        assert shard.heads == 64 // tp and shard.kv_heads == 8 // tp and shard.intermediate * tp == 29568
