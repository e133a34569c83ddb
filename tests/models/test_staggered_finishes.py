"""Requests that finish at different steps (max_new_tokens, stop tokens) while others join, decode and prefill in
chunks: each step is launched before the previous one is read back, its decode rows fed on the device from the
previous step's samples, so a wrong feed (a row given another request's token, or a stale one) shows as tokens
unlike HF's. Few table rows, so a finished request's row is soon reused; a greedy request with a repetition penalty
runs among them, its counts kept on the device step after step (a penalty below 1 favours the ids already seen, so
its answer depends on every sample counted: this tiny model's own answers repeat none); every KV slot and row comes
back."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from language.request import Request
from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from tests.models.hf_reference import hf_greedy
from tests.models.staggered import run_staggered

MAX_NEW = 20
ROWS = 4


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


_ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=_ON_GPU)])
def llm(tiny_llama_dir, request):
    """On a GPU: decode graphs and piecewise graphs, so steps really queue behind the one in flight."""
    return LLM(tiny_llama_dir, max_total_token_num=4096, device=request.param, data_type="float32",
               running_max_req_size=ROWS, chunked_prefill_size=24)  # fmt: skip


def _prompts(vocab: int, n: int) -> list[list[int]]:
    rng = random.Random(1)
    shared = [1] + [rng.randrange(3, vocab) for _ in range(12)]  # a common prefix: prefix-cache hits
    return [(shared if i % 3 == 0 else [1]) + [rng.randrange(3, vocab) for _ in range(4 + 7 * i)] for i in range(n)]


def _case(i: int, reference: list[int]) -> tuple[SamplingParams, list[int], str]:
    """Request i's parameters, its expected tokens and finish reason: a stop token taken from its own reference at
    a varying step, or a varying max_new_tokens."""
    if i % 2:
        stop = reference[(i * 5) % MAX_NEW]
        expected = reference[: reference.index(stop) + 1]
        return SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[stop]), expected, "stop"
    n = 1 + (i * 7) % MAX_NEW
    return SamplingParams(max_new_tokens=n, ignore_eos=True), reference[:n], "length"


def test_staggered_finishes_equal_hf_and_free_every_slot(llm, hf_model):
    prompts = _prompts(hf_model.config.vocab_size, 11)
    refs = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    cases = [_case(i, ref) for i, ref in enumerate(refs)]
    reqs = [Request(f"r{i}", p, params) for i, (p, (params, _, _)) in enumerate(zip(prompts, cases, strict=True))]
    penalised = [1] + prompts[4][1:9]
    reqs.append(Request("penalised", penalised, SamplingParams(max_new_tokens=MAX_NEW, repetition_penalty=0.5,
                                                                   ignore_eos=True)))  # fmt: skip
    run_staggered(llm.engine, reqs, join_every=2, at_once=3)
    for r, (_, expected, reason) in zip(reqs, cases, strict=False):
        assert (r.output_ids, r.finish_reason) == (expected, reason), r.rid
    assert reqs[-1].output_ids == hf_greedy(hf_model, penalised, MAX_NEW, repetition_penalty=0.5)
    engine = llm.engine
    if engine.model_info.device.type == "cuda":
        assert engine.runner.graphs is not None and engine.runner.pieces is not None
    while engine.has_unfinished():  # the wasted row of the last request to stop may still be in flight
        engine.step()
    assert engine.stats().kv_used == 0 and engine.kv.num_free_rows() == ROWS
    assert engine.kv.slots.num_used == engine.prefix.total_tokens  # all that is held is the tree's
