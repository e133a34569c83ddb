"""On a GPU: programmatic dependent launch changes when the decode step's kernels start, never what they compute.
The logits of every decode step, eager and replayed from CUDA graphs, in bf16 and under --quant_type fp8w8a8
(batch 1: the FP8 GEMV; 2 to 64: the skinny GEMM), at several batch sizes, are bit-equal with PDL on and off.
Skipped without CUDA; PDL itself needs sm_90+ (elsewhere both runs launch without it, and the test is skipped)."""

from __future__ import annotations

import random

import pytest
import torch

from language.kernels.launch_utils import set_pdl, use_pdl
from language.request import Request
from language.sampling_params import SamplingParams
from mmserve.llm import LLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm_90+ GPU"
    ),
]
NEW_TOKENS = 6
BATCHES = (1, 3, 8)


def decode_logits(model_dir: str, *, pdl: bool, cuda_graph: bool, quant_type: str) -> list[torch.Tensor]:
    """The logits of every pure decode step (one batch size after another), in order, on the host."""
    llm = LLM(model_dir, max_total_token_num=4096, device="cuda", data_type="bfloat16", quant_type=quant_type,
              pdl=pdl, cuda_graph=cuda_graph)  # fmt: skip
    try:
        runner = llm.engine.runner
        assert use_pdl(runner.device) == pdl
        assert (runner.graphs is not None) == cuda_graph
        recorded: list[torch.Tensor] = []
        forward = runner.forward

        def record(staged):
            fwd = forward(staged)
            if not staged.prefill.reqs:
                recorded.append(fwd.logits[: len(staged.decode.reqs)].float().cpu())
            return fwd

        runner.forward = record
        rng = random.Random(7)
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        for b in BATCHES:
            prompts = [[1] + [rng.randrange(3, 200) for _ in range(5 + 7 * i)] for i in range(b)]
            llm.run([Request(f"pdl-{b}-{i}", p, params) for i, p in enumerate(prompts)])
        return recorded
    finally:
        llm.engine.close()
        set_pdl(True)


@pytest.mark.parametrize("quant_type", ["none", "fp8w8a8"])
@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
def test_decode_logits_bit_equal_with_pdl_on_and_off(tiny_llama_dir, quant_type: str, cuda_graph: bool) -> None:
    on = decode_logits(tiny_llama_dir, pdl=True, cuda_graph=cuda_graph, quant_type=quant_type)
    off = decode_logits(tiny_llama_dir, pdl=False, cuda_graph=cuda_graph, quant_type=quant_type)
    assert len(on) == len(off) >= len(BATCHES) * (NEW_TOKENS - 2)
    assert {t.shape[0] for t in on} >= set(BATCHES)
    for step, (a, b) in enumerate(zip(on, off, strict=True)):
        assert torch.equal(a, b), f"decode step {step} (batch {a.shape[0]}): logits differ with PDL on and off"
