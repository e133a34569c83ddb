"""On a GPU: the overlapped engine with Triton kernels, CUDA-graph decode and chunked prefill (mixed decode +
prefill steps) gives HF's greedy tokens. Skipped without CUDA; run on the GPU host with `pytest tests/models`."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from language.request import Request
from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from mmserve.testing.fidelity import TOP_K, check_top_k_rule, engine_top_k
from tests.models.hf_reference import hf_greedy
from tests.models.staggered import assert_greedy_equals_hf, run_staggered

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("chunk", [4096, 13])
def test_staggered_requests_equal_hf_on_gpu(tiny_llama_dir, hf_model, chunk):
    llm = LLM(tiny_llama_dir, max_total_token_num=8192, device="cuda", data_type="float32", chunked_prefill_size=chunk)
    assert llm.engine.runner.graphs is not None
    rng = random.Random(1)
    vocab = hf_model.config.vocab_size
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(n)] for n in (3, 40, 9, 120, 1, 77)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = [Request(f"g{chunk}-{i}", p, params) for i, p in enumerate(prompts)]
    run_staggered(llm.engine, reqs, join_every=4)  # join while others decode: mixed steps
    assert_greedy_equals_hf(llm.engine, reqs, hf_model, NEW_TOKENS)


def test_bf16_decode_batches_follow_hf_on_gpu(tiny_llama_dir, hf_model):
    """bf16 on CUDA: decode batches of 2 to 6 run every linear, the LM head included, through the weight-streaming
    GEMM (kernels.SKINNY_MAX_ROWS). bf16 sums cannot equal HF's fp32 ones bit for bit, so the fidelity rule holds
    them: at the first divergence of the greedy tokens, each side's token is among the other's top 5."""
    llm = LLM(tiny_llama_dir, max_total_token_num=8192, device="cuda", data_type="bfloat16")
    rng = random.Random(2)
    vocab = hf_model.config.vocab_size
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(n)] for n in (5, 33, 12, 70, 2, 48)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = [Request(f"bf16-{i}", p, params) for i, p in enumerate(prompts)]
    run_staggered(llm.engine, reqs, join_every=2, at_once=3)
    for r in reqs:
        theirs = hf_greedy(hf_model, r.prompt_ids, NEW_TOKENS)
        broken = check_top_k_rule(
            r.output_ids,
            theirs,
            lambda i, r=r, theirs=theirs: engine_top_k(llm, r.prompt_ids + theirs[:i]),
            lambda i, r=r, theirs=theirs: _hf_top_k(hf_model, r.prompt_ids + theirs[:i]),
        )
        assert broken is None, f"{r.rid}: {broken}"


def _hf_top_k(hf_model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
    return logits.topk(TOP_K).indices.tolist()
