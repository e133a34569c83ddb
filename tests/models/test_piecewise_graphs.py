"""Piecewise graphs (language/piecewise_graphs.py): prompt and mixed steps run piece by piece, the attention
launched eagerly between the pieces, padded to a captured size, and give HF's greedy tokens. On CPU the pieces run
uncaptured (the static buffers, the padding, the dummy slots of padded rows and the attention between pieces are
the same code); on a GPU they replay CUDA graphs beside the decode graphs."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from language.piecewise_graphs import PiecewiseGraphs, piecewise_sizes
from language.request import Request
from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from tests.models.staggered import assert_greedy_equals_hf, run_staggered

NEW_TOKENS = 12
MAX_TOKENS = 32
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]  # fmt: skip


def test_sizes_pad_by_under_a_quarter() -> None:
    sizes = piecewise_sizes(1024)
    assert sizes[:8] == list(range(16, 129, 16)) and sizes[-1] == 1024
    assert all(b % 16 == 0 and a < b <= 1.25 * a for a, b in zip(sizes[7:], sizes[8:], strict=False))
    assert piecewise_sizes(1000)[-1] == 1008 and piecewise_sizes(20) == [16, 32] and piecewise_sizes(1) == [16]


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("device", DEVICES)
def test_staggered_requests_through_pieces_equal_hf(tiny_llama_dir, hf_model, device: str) -> None:
    """Requests join while others decode, prompts in chunks of up to 40 tokens: steps of up to MAX_TOKENS run
    through the pieces (sizes 16 and 32, so a step often pads over rows a larger step had given live slots);
    longer ones (the first step of a 76-token burst) run eagerly."""
    llm = LLM(tiny_llama_dir, max_total_token_num=8192, device=device, data_type="float32", chunked_prefill_size=40,
              piecewise_cuda_graph_max_tokens=MAX_TOKENS)  # fmt: skip
    runner = llm.engine.runner
    if device == "cpu":
        assert runner.pieces is None  # only built on a GPU; the test runs them uncaptured
        runner.pieces = PiecewiseGraphs(runner.model, runner.kv, runner.device, MAX_TOKENS)
    assert runner.pieces is not None and runner.pieces.sizes == [16, 32]
    through_pieces, eager = [], []
    pieces_forward, model_forward = runner.pieces.forward, runner.model.forward
    runner.pieces.forward = lambda batch: through_pieces.append(len(batch.input_ids)) or pieces_forward(batch)
    runner.model.forward = lambda batch: eager.append(len(batch.input_ids)) or model_forward(batch)

    rng = random.Random(3)
    vocab = hf_model.config.vocab_size
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(n)] for n in (30, 3, 40, 9, 70, 1, 17)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = [Request(f"pw-{device}-{i}", p, params) for i, p in enumerate(prompts)]
    # The first three together (76 prompt tokens: a 40-token step, then 36 beside no decode row), then the rest
    # one every three steps.
    run_staggered(llm.engine, reqs, join_every=3, at_once=3)
    assert_greedy_equals_hf(llm.engine, reqs, hf_model, NEW_TOKENS)
    assert any(n <= 16 for n in through_pieces) and any(16 < n <= 32 for n in through_pieces)
    assert all(n <= MAX_TOKENS for n in through_pieces)
    if device == "cpu":  # on a GPU decode-only steps replay the decode graphs instead
        assert any(n > MAX_TOKENS for n in eager)
