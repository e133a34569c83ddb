"""The engine at tp=2 on gloo (rank 0: EngineCore, rank 1: TPWorker following its steps) gives HF's greedy tokens
on the tiny Llama, with KV heads split (2 KV heads) and replicated (1 KV head). A seeded sampled request in the
batch sends its step's samples to rank 1; the greedy requests beside it must stay exact, so rank 1's copy of the
last tokens is right. InternVL in the -hf layout with images, whose rows reach rank 1 through the step's broadcast,
gives HF's greedy tokens too."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM

from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from mmserve.testing.checkpoints.llama import build_llama
from tests.models.hf_reference import hf_greedy
from tests.parallel.ranks import run_ranks

NEW_TOKENS = 12


def _engine_on_rank(
    rank: int,
    init_method: str,
    model_dir: str,
    prompts: list[list[int]],
    kv_type: str = "None",
    quant_type: str = "none",
):
    from language.config import EngineConfig
    from language.parallel.worker import TPWorker
    from language.sampling_params import SamplingParams
    from mmserve.llm import LLM

    kwargs = dict(max_total_token_num=2048, device="cpu", tp=2, dist_init_method=init_method, chunked_prefill_size=64,
                  llm_kv_type=kv_type, quant_type=quant_type)  # fmt: skip
    if rank:
        TPWorker(EngineConfig(model_dir=model_dir, **kwargs), rank).serve()
        return None
    llm = LLM(model_dir, **kwargs)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, do_sample=True, temperature=0.8, seed=3)
    out = llm.generate(prompts + [prompts[0]], [greedy] * len(prompts) + [sampled])
    llm.engine.close()
    return [g.token_ids for g in out[:-1]], len(out[-1].token_ids), llm.engine.stats().kv_used


@pytest.mark.parametrize("kv_heads", [1])  # split KV heads (2 of them): the e2e tests at --tp 2
def test_tp2_greedy_equals_hf(tmp_path, kv_heads):
    model_dir = build_llama(str(tmp_path / "llama"), num_key_value_heads=kv_heads)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(kv_heads)
    prompts = [[1] + [rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in (3, 40, 150)]
    tokens, sampled_len, kv_used = run_ranks(_engine_on_rank, model_dir, prompts)
    assert tokens == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert sampled_len == NEW_TOKENS and kv_used == 0


def test_tp2_int8_kv_equals_one_process(tmp_path):
    """--llm_kv_type int8kv with the KV heads split: each rank stores its heads' int8 rows and their scales, which
    depend on nothing the other rank holds, so the tokens are the single process's (issue 33)."""
    model_dir = build_llama(str(tmp_path / "llama"), num_key_value_heads=2)
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in (5, 90)]
    tokens, _, _ = run_ranks(_engine_on_rank, model_dir, prompts, "int8kv")
    llm = LLM(model_dir, max_total_token_num=2048, device="cpu", llm_kv_type="int8kv")
    alone = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert tokens == [g.token_ids for g in alone]


def test_tp2_fp8_follows_tp1_fp8(tmp_path):
    """--quant_type fp8w8a8 at tp=2: q/k/v and gate/up scales are each rank's rows', o/down's whole rows' (the same
    e4m3 weights as tp=1); only the row-parallel layers' activation scales are per rank. Greedy tokens follow tp=1's
    under the fidelity rule's side we can read here (ours in tp=1's top 5 at the first divergence), on a checkpoint
    with margins (embeddings x4)."""
    from language.sampling_params import SamplingParams
    from mmserve.llm import LLM
    from mmserve.testing.checkpoints.fp8 import scale_embeddings
    from mmserve.testing.fidelity import engine_top_k, first_divergence

    model_dir = scale_embeddings(build_llama(str(tmp_path / "llama"), num_key_value_heads=2), 4.0)
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in (3, 40)]
    tokens, _, _ = run_ranks(_engine_on_rank, model_dir, prompts, "None", "fp8w8a8")
    tp1 = LLM(model_dir, max_total_token_num=2048, device="cpu", quant_type="fp8w8a8")
    for prompt, ours in zip(prompts, tokens, strict=True):
        theirs = tp1.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))[0].token_ids
        i = first_divergence(ours, theirs)
        assert i is None or ours[i] in engine_top_k(tp1, prompt + theirs[:i]), (i, ours, theirs)
        assert i is None or i >= NEW_TOKENS // 2, (i, ours, theirs)


def _mm_engine_on_rank(
    rank: int, init_method: str, model_dir: str, prompts: list[list[int]], items: list[list], new_tokens: int
):
    from language.config import EngineConfig
    from language.parallel.worker import TPWorker
    from language.sampling_params import SamplingParams
    from mmserve.llm import LLM

    kwargs = dict(max_total_token_num=2048, device="cpu", data_type="float32", tp=2, dist_init_method=init_method,
                  chunked_prefill_size=32)  # fmt: skip
    if rank:
        TPWorker(EngineConfig(model_dir=model_dir, **kwargs), rank).serve()
        return None
    llm = LLM(model_dir, **kwargs)
    out = llm.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), mm_items=items)
    llm.engine.close()
    return [g.token_ids for g in out]


def _internvl_inputs(model_dir: str, internvl) -> tuple[list[list[int]], list[list]]:
    """Each prompt's ids and image rows, from our prompt processor and vision model (as the server's processes)."""
    from transformers import AutoTokenizer

    from language.request import MultimodalItem
    from mmserve.prep.multimodal.prompt import prompt_processor_class
    from visual.models.internvl import InternVLVisionModel

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompter = prompt_processor_class("InternVLForConditionalGeneration").from_pretrained(model_dir, tokenizer)
    vision = InternVLVisionModel.from_pretrained(model_dir, torch.device("cpu"), torch.float32)
    embeds = vision.encode([vision.preprocess(im) for im in internvl.IMAGES])
    prompts, items = [], []
    for text, image_ids in internvl.PROMPTS:
        mm = prompter.encode(text, [internvl.IMAGES[i].size for i in image_ids])
        prompts.append(mm.token_ids)
        items.append([MultimodalItem(o, embeds[i]) for o, i in zip(mm.offsets, image_ids, strict=True)])
    return prompts, items


def test_internvl_hf_tp2_equals_hf(tmp_path):
    """InternVL in the transformers-native layout (InternVL3's Qwen2 language model, q/k/v biases split by heads):
    one image, two images of different tile counts (their rows reach rank 1 through the step's broadcast, in 32-token
    prefill chunks) and text alone, batched, give HF's greedy tokens. (The server's --tp 2 path: test_tp_server.py
    on InternVL's remote-code layout and on Gemma 3.)"""
    from transformers import AutoProcessor, InternVLForConditionalGeneration

    from visual.models.internvl import MIN_TRANSFORMERS

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        pytest.skip(f"InternVL needs transformers >= {MIN_TRANSFORMERS}")
    from mmserve.testing.checkpoints.internvl import build_internvl_hf
    from tests.models import test_internvl as internvl

    model_dir = build_internvl_hf(str(tmp_path / "internvl"))
    prompts, items = _internvl_inputs(model_dir, internvl)
    ours = run_ranks(_mm_engine_on_rank, model_dir, prompts, items, internvl.NEW_TOKENS)
    processor = AutoProcessor.from_pretrained(model_dir)
    hf = InternVLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    for (text, image_ids), prompt, got in zip(internvl.PROMPTS, prompts, ours, strict=True):
        inputs = processor(text=text, images=[internvl.IMAGES[i] for i in image_ids] or None, return_tensors="pt")
        assert prompt == inputs["input_ids"][0].tolist(), text
        assert got == internvl.hf_greedy(hf, inputs), text
