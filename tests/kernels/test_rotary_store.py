import pytest
import torch
from kernel_cases import DEVICE, dtype_params, poisoned, randn, strided_view

from language.kernels.kv_store import store_kv
from language.kernels.reference import rotary_cos_sin_ref, rotary_store_kv_ref
from language.kernels.rotary import apply_rotary
from language.kernels.rotary_store import rotary_store_kv


def inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=DEVICE) / head_dim))


def case(dtype, num_tokens, num_heads, num_kv_heads, head_dim, num_slots=50):
    gen = torch.Generator().manual_seed(num_tokens * 31 + num_heads)
    qkv = strided_view(randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, generator=gen))
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = rotary_cos_sin_ref(positions, inv_freq(head_dim))
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens].to(DEVICE)  # scattered slots
    return qkv, cos, sin, slots


@dtype_params
@pytest.mark.parametrize(
    "num_tokens, num_heads, num_kv_heads, head_dim", [(1, 4, 2, 16), (9, 7, 1, 80), (5, 28, 4, 128), (3, 2, 2, 32)]
)
def test_rotary_store_kv_equals_rotary_then_store(dtype, num_tokens, num_heads, num_kv_heads, head_dim):
    """Equal to the two launches it replaces (apply_rotary on q and k, store_kv of k and v), and to the
    reference; slots not written keep their old content, and qkv is left untouched."""
    qkv, cos, sin, slots = case(dtype, num_tokens, num_heads, num_kv_heads, head_dim)
    qkv_before = qkv.clone()
    shape = (50, num_kv_heads, head_dim)
    k_cache, v_cache = poisoned(shape, dtype), poisoned(shape, dtype)
    q = rotary_store_kv(qkv, cos, sin, k_cache, v_cache, slots.int(), num_heads)

    qk = apply_rotary(qkv[:, : num_heads + num_kv_heads], cos, sin)
    k_two, v_two = poisoned(shape, dtype), poisoned(shape, dtype)
    store_kv(k_two, v_two, qk[:, num_heads:], qkv[:, num_heads + num_kv_heads :], slots)
    k_ref, v_ref = poisoned(shape, dtype), poisoned(shape, dtype)
    q_ref = rotary_store_kv_ref(qkv, cos, sin, k_ref, v_ref, slots, num_heads)

    assert q.shape == (num_tokens, num_heads, head_dim) and q.is_contiguous()
    assert not k_cache[slots].isnan().any() and not v_cache[slots].isnan().any(), "a slot was left unwritten"
    exact = dict(atol=0, rtol=0, equal_nan=True)
    # Half types round after each product, so the compiled kernels agree bit for bit; in fp32 the compiler may
    # contract a product and the sum into one FMA in one kernel and not the other (one ulp).
    same = exact if dtype != torch.float32 else dict(atol=1e-6, rtol=1e-6, equal_nan=True)
    torch.testing.assert_close(q, qk[:, :num_heads], **same)
    torch.testing.assert_close(k_cache, k_two, **same)
    torch.testing.assert_close(v_cache, v_two, **exact)
    # The reference rounds as the kernels do, up to the interpreter's bf16 rounding of single products.
    tol = dict(atol=1.6e-2, rtol=1.6e-2, equal_nan=True) if dtype == torch.bfloat16 else exact
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k_cache, k_ref, **tol)
    torch.testing.assert_close(v_cache, v_ref, **exact)
    torch.testing.assert_close(qkv, qkv_before, atol=0, rtol=0)


def test_rotary_store_kv_rejects_head_mismatch():
    qkv, cos, sin, slots = case(torch.float32, 3, 4, 2, 16)
    cache = torch.zeros(50, 3, 16, device=DEVICE)  # 3 KV heads, but qkv holds 4 + 2 * 2 heads
    with pytest.raises(AssertionError, match="qkv:"):
        rotary_store_kv(qkv, cos, sin, cache, cache.clone(), slots, 4)
