"""The penalties kernel against the torch reference: rows pointing at table rows in any order (the zero row of a
request without penalties among them), penalties above and below 1, negative frequency and presence, ids in the
prompt, in the output, in both and in neither, logits of both signs, a strided logits view, a vocabulary that is
not a multiple of the block. Both sides round the same fp32 operations the same way (the kernel has no fused
multiply-add), so the results are equal."""

import pytest
import torch
from kernel_cases import DEVICE, strided_view

from language.kernels.penalties import BLOCK, penalize
from language.kernels.sampling_reference import penalize_ref


@pytest.mark.parametrize("rows, vocab", [(1, 300), (5, BLOCK + 77), (9, 2 * BLOCK)])
def test_matches_the_reference(rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    tables = 6
    sparse = torch.rand(tables, vocab, generator=gen) < 0.1
    counts = torch.randint(0, 4, (tables, vocab), generator=gen).float() * sparse
    in_prompt = torch.rand(tables, vocab, generator=gen) < 0.05
    counts[0], in_prompt[0] = 0, False  # the zero row
    table_rows = torch.randint(0, tables, (rows,), generator=gen)
    table_rows[0] = 0
    logits = torch.randn(rows, vocab, generator=gen) * 5
    repetition = torch.rand(rows, generator=gen) * 2 + 0.3
    repetition[0] = 1.0
    frequency = torch.randn(rows, generator=gen)
    presence = torch.randn(rows, generator=gen)
    args = [t.to(DEVICE) for t in (table_rows, counts, in_prompt, repetition, frequency, presence)]
    ours = penalize(strided_view(logits.to(DEVICE), pad=3), *args)
    want = penalize_ref(logits.to(DEVICE), *args)
    assert torch.equal(ours, want), (ours - want).abs().max()
    assert torch.equal(want[0], logits[0].to(DEVICE))  # the zero row (no penalties) changes nothing
