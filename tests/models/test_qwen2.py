"""A tiny random Qwen2 text model (Llama's layout with q/k/v biases): our engine's greedy tokens equal HF
transformers' generate, batched."""

import random

import torch
from transformers import AutoModelForCausalLM

from families import family
from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from tests.models.hf_reference import hf_greedy

NEW_TOKENS = 24


def test_batched_greedy_equals_hf(tmp_path):
    model_dir = family("Qwen2ForCausalLM").part("test_checkpoint")(str(tmp_path))
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "Qwen2ForCausalLM" and hf_model.model.layers[0].self_attn.q_proj.bias is not None
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, hf_model.config.vocab_size) for _ in range(n)] for n in (1, 9, 57)]
    llm = LLM(model_dir, max_total_token_num=4096, device="cpu")
    ours = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, gen in zip(prompts, ours, strict=True):
        assert gen.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)
