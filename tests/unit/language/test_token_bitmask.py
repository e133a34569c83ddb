"""The sampler's grammar mask: our torch op that unpacks xgrammar's token bitmask into -inf fills gives exactly what
xgrammar's own apply_token_bitmask_inplace gives, on the constrained rows only."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from language.request import Request
from language.sampler import SamplingBatch, apply_token_bitmask, sample
from language.sampling_params import SamplingParams, StructuredOutput


@pytest.mark.parametrize("vocab", [32, 100, 517])
def test_matches_xgrammar_on_the_constrained_rows(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    words = -(-vocab // 32)
    full = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=gen)  # xgrammar's layout
    full[4] = -1  # every id allowed
    full[0] = 0
    full[0, 0] = 1  # only id 0
    rows = [4, 0, 2]

    ours = apply_token_bitmask(logits, torch.tensor(rows), full[rows])

    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, full, vocab_size=vocab, indices=rows, backend="cpu")
    assert torch.equal(ours, expected)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])  # unconstrained rows untouched
    assert torch.isfinite(ours[0]).tolist() == [True] + [False] * (vocab - 1)
    assert torch.isfinite(ours[4]).all()


def test_out_of_place():
    logits = torch.randn(2, 64)
    before = logits.clone()
    apply_token_bitmask(logits, torch.tensor([1]), torch.zeros(1, 2, dtype=torch.int32))
    assert torch.equal(logits, before)


def test_sampled_tokens_and_logprobs_come_from_the_masked_logits():
    """Greedy and sampled rows only ever pick an allowed id, and its log-probability is over the allowed ids."""
    vocab = 70
    logits = torch.randn(2, vocab)
    allowed = [5, 40, 66]
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    for t in allowed:
        bitmask[:, t // 32] |= 1 << (t % 32)
    so = StructuredOutput("regex", "a")
    reqs = [
        Request("g", [1], SamplingParams(structured=so)),
        Request("s", [1], SamplingParams(do_sample=True, structured=so)),
    ]
    for _ in range(20):
        sb = SamplingBatch.build(reqs, vocab, torch.device("cpu"))
        sb.token_mask = (torch.tensor([0, 1]), bitmask)
        out = sample(logits, sb)
        assert set(out.ids.tolist()) <= set(allowed)
        expected = torch.log_softmax(logits[:, allowed], dim=-1)
        for row in range(2):
            assert out.logprobs[row].item() == pytest.approx(expected[row, allowed.index(out.ids[row].item())].item())
    assert out.ids[0].item() == allowed[int(logits[0, allowed].argmax())]
