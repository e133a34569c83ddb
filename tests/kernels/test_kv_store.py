import pytest
import torch
from kernel_cases import DEVICE, dtype_params, poisoned, randn, strided_view

from language.kernels.kv_store import store_kv
from language.kernels.reference import store_kv_ref


@dtype_params
@pytest.mark.parametrize("num_tokens, num_kv_heads, head_dim", [(1, 2, 16), (9, 3, 80), (17, 1, 128)])
def test_store_kv_matches_reference(dtype, num_tokens, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_tokens)
    num_slots = 40
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens].to(DEVICE)  # scattered slots
    k = strided_view(randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, generator=gen))
    v = strided_view(randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, generator=gen))
    shape = (num_slots, num_kv_heads, head_dim)
    k_expected, v_expected = poisoned(shape, dtype), poisoned(shape, dtype)
    store_kv_ref(k_expected, v_expected, k, v, slots)
    k_cache, v_cache = poisoned(shape, dtype), poisoned(shape, dtype)
    store_kv(k_cache, v_cache, k, v, slots.int())

    assert not k_cache[slots].isnan().any() and not v_cache[slots].isnan().any(), "a slot was left unwritten"
    # Stores are copies: bit-exact, and slots not in `slots` keep their old content (NaN).
    torch.testing.assert_close(k_cache, k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, atol=0, rtol=0, equal_nan=True)


def test_store_kv_casts_to_cache_dtype():
    gen = torch.Generator().manual_seed(3)
    k = randn(4, 2, 32, dtype=torch.float32, generator=gen)
    slots = torch.tensor([7, 1, 3, 5], device=DEVICE)
    k_cache, v_cache = poisoned((8, 2, 32), torch.float16), poisoned((8, 2, 32), torch.float16)
    store_kv(k_cache, v_cache, k, -k, slots)
    torch.testing.assert_close(k_cache[slots], k.half(), atol=0, rtol=0)
    torch.testing.assert_close(v_cache[slots], -k.half(), atol=0, rtol=0)


def test_store_kv_rejects_head_mismatch():
    cache = torch.zeros(8, 2, 32, device=DEVICE)
    k = torch.zeros(3, 4, 32, device=DEVICE)
    with pytest.raises(AssertionError, match="k:"):
        store_kv(cache, cache.clone(), k, k, torch.arange(3, device=DEVICE))
