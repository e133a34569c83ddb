"""The KV cache's size in slots counts the bytes a slot really takes (--llm_kv_type): K and V rows in the storage
dtype plus int8's per-slot scales, so the same memory holds about twice the tokens in 8 bits."""

import os

import pytest
import torch

from language.config import EngineConfig, LMConfig
from language.kv_cache import KVCache
from language.model_builder import kv_capacity

# Qwen2-VL-7B's decoder: 28 layers, 4 KV heads of 128
QWEN2_VL_7B = dict(num_layers=28, num_kv_heads=4, head_dim=128)
KV_TYPES = ("None", "int8kv", "fp8kv")


def test_bytes_per_token_of_the_7b_shape():
    per_token = {t: KVCache.bytes_per_token(**QWEN2_VL_7B, dtype=torch.bfloat16, kv_type=t) for t in KV_TYPES}
    assert per_token == {"None": 57344, "int8kv": 29568, "fp8kv": 28672}
    assert per_token["None"] / per_token["int8kv"] >= 1.9


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_counted_bytes_are_the_allocated_bytes(kv_type):
    kv = KVCache(3, 40, 2, 16, 4, 64, torch.bfloat16, torch.device("cpu"), kv_type)
    per_slot = [t for t in kv.k + kv.v + kv.k_scale + kv.v_scale if t is not None and t.shape[0] == 41]
    assert sum(t.nbytes for t in per_slot) == 41 * kv.slot_bytes
    assert kv.k[0].dtype == {"None": torch.bfloat16, "int8kv": torch.int8, "fp8kv": torch.float8_e4m3fn}[kv_type]
    if kv_type == "fp8kv":  # one scale per KV head and layer, 1.0 (uncalibrated)
        assert all(s.shape == (2,) and (s == 1).all() for s in kv.k_scale + kv.v_scale)


def test_same_memory_holds_nearly_twice_the_tokens(monkeypatch):
    lm = LMConfig(architecture="Qwen2VLForConditionalGeneration", hidden_size=3584, num_heads=28, intermediate_size=1,
                  vocab_size=1, rms_norm_eps=1e-6, rope_theta=1e6, max_position=4096, eos_token_ids=(0,),
                  torch_dtype=torch.bfloat16, num_layers=28, num_kv_heads=4, head_dim=128)  # fmt: skip
    page = 4096
    pages = 1000 * 57344 * 4 // page  # a CPU process sizes its cache to a quarter of the free memory: 1000 bf16 slots
    sysconf = {"SC_PAGE_SIZE": page, "SC_AVPHYS_PAGES": pages}
    monkeypatch.setattr(os, "sysconf", sysconf.__getitem__)
    slots = {
        kv_type: kv_capacity(EngineConfig(model_dir="x", llm_kv_type=kv_type), lm, 4, torch.bfloat16,
                             torch.device("cpu"))
        for kv_type in ("None", "int8", "fp8")
    }  # fmt: skip
    assert slots == {"None": 1000, "int8": 1939, "fp8": 2000}
