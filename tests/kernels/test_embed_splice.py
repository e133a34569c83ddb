import torch
from kernel_cases import DEVICE, ELEMENTWISE_TOL, assert_written_and_close, dtype_params, poisoned, randn

from language.kernels.embed_splice import splice_embeddings
from language.kernels.reference import splice_embeddings_ref


@dtype_params
def test_splice_embeddings_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens, hidden = 23, 1100  # hidden spans two column blocks
    mm_positions = torch.cat([torch.arange(2, 9), torch.tensor([14, 20])]).to(DEVICE)  # one image run + strays
    mm_embeds = randn(9, hidden, dtype=torch.float32, generator=gen)  # vision tower output in fp32: cast on store
    text = randn(num_tokens, hidden, dtype=dtype, generator=gen)

    expected = text.clone()
    splice_embeddings_ref(expected, mm_embeds, mm_positions)
    actual = text.clone()
    splice_embeddings(actual, mm_embeds, mm_positions)
    assert_written_and_close(actual, expected, ELEMENTWISE_TOL)


@dtype_params
def test_splice_embeddings_writes_every_placeholder_row(dtype):
    gen = torch.Generator().manual_seed(1)
    mm_positions = torch.tensor([0, 3, 4, 5, 9], device=DEVICE)
    embeds = poisoned((10, 64), dtype)
    splice_embeddings(embeds, randn(5, 64, dtype=dtype, generator=gen), mm_positions)
    written = embeds[mm_positions]
    assert not written.isnan().any()
    others = torch.ones(10, dtype=torch.bool, device=DEVICE)
    others[mm_positions] = False
    assert embeds[others].isnan().all(), "rows that are not placeholders were overwritten"
