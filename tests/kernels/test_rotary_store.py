"""rotary_store_kv (language/kernels/rotary_store.py): one launch equal bit for bit to the two it replaces,
apply_rotary over q and k side by side, then store_kv of the rotated k and v, in every cache encoding."""

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, poisoned, randn
from test_kv_quant import cache_bits, empty_scales

from language import kernels
from language.kernels.kv_store import store_kv
from language.kernels.reference import mrope_cos_sin_ref, rotary_cos_sin_ref
from language.kernels.rotary import apply_rotary
from language.kernels.rotary_store import rotary_store_kv

CACHES = [None, torch.int8, torch.float8_e4m3fn]  # None: the cache in the model's dtype
cache_params = pytest.mark.parametrize("cache_dtype", CACHES, ids=["plain", "int8", "fp8"])
dtype_params = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
NUM_SLOTS = 40


def fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen) -> torch.Tensor:
    """[N, (Hq + 2 Hk) * D] rows, 5 elements further apart than contiguous (as a qkv projection's output sliced)."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    return (randn(num_tokens, width + 5, dtype=dtype, generator=gen) * 3)[:, :width]


def cos_sin(kind: str, num_tokens: int, head_dim: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain RoPE or Qwen2-VL's 3-axis M-RoPE tables [N, D/2], as column slices of a wider table (Gemma 3's layers
    each take a half of theirs)."""
    inv_freq = (1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)).to(DEVICE)
    if kind == "rope":
        tables = rotary_cos_sin_ref(torch.randint(0, 4096, (num_tokens,), generator=gen).to(DEVICE), inv_freq)
    else:
        half = head_dim // 2
        section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
        positions = torch.randint(0, 3000, (3, num_tokens), generator=gen).to(DEVICE)
        tables = mrope_cos_sin_ref(positions, inv_freq, section)
    return tuple(torch.cat([t, torch.full_like(t, float("nan"))], dim=1)[:, : head_dim // 2] for t in tables)


def split(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """-> q [N, Hq, D], k [N, Hk, D], v [N, Hk, D], and q with k [N, Hq + Hk, D]: views of qkv."""
    n, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    qk = qkv[:, : q_size + kv_size].view(n, num_heads + num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(n, num_kv_heads, head_dim)
    return qk[:, :num_heads], qk[:, num_heads:], v, qk


def new_caches(cache_dtype, dtype, num_kv_heads, head_dim):
    """k_cache, v_cache (old content 7 in every slot), k_scale, v_scale."""
    shape = (NUM_SLOTS, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 7, dtype=torch.int8, device=DEVICE).to(cache_dtype or dtype)
    if cache_dtype is None:
        return k_cache, k_cache.clone(), None, None
    return k_cache, k_cache.clone(), *empty_scales(cache_dtype, NUM_SLOTS, num_kv_heads)


@dtype_params
@cache_params
@pytest.mark.parametrize(
    "num_tokens, num_heads, num_kv_heads, head_dim, rope, normed",
    [
        (1, 4, 2, 16, "rope", False),
        (1, 28, 4, 128, "mrope", False),  # Qwen2-VL-7B's decode step
        (6, 6, 3, 80, "mrope", True),
        (9, 5, 1, 64, "rope", True),
    ],
)
def test_equals_rotary_then_store(dtype, cache_dtype, num_tokens, num_heads, num_kv_heads, head_dim, rope, normed):
    """normed: q and k come from a contiguous [N, Hq + Hk, D] (the qk norms' output), v from qkv: other strides."""
    gen = torch.Generator().manual_seed(num_tokens * num_heads + head_dim)
    qkv = fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen)
    qkv_before = qkv.clone()
    cos, sin = cos_sin(rope, num_tokens, head_dim, gen)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:num_tokens].to(DEVICE)  # scattered
    q, k, v, qk = split(qkv, num_heads, num_kv_heads, head_dim)
    if normed:
        qk = qk.contiguous()
        q, k = qk[:, :num_heads], qk[:, num_heads:]

    rotated = apply_rotary(qk, cos, sin)
    expected = new_caches(cache_dtype, dtype, num_kv_heads, head_dim)
    store_kv(*expected[:2], rotated[:, num_heads:], v, slots, k_scale=expected[2], v_scale=expected[3])
    actual = new_caches(cache_dtype, dtype, num_kv_heads, head_dim)
    out = poisoned((num_tokens, num_heads, head_dim), dtype)
    q_rotated = rotary_store_kv(
        q, k, v, cos, sin, actual[0], actual[1], slots.int(), k_scale=actual[2], v_scale=actual[3], out=out
    )

    assert q_rotated is out
    torch.testing.assert_close(q_rotated, rotated[:, :num_heads], atol=0, rtol=0)
    # The caches and their scales bit for bit, slots not stored keeping their old rows (and NaN int8 scales).
    for want, got in zip(expected, actual, strict=True):
        if want is not None:
            torch.testing.assert_close(cache_bits(got), cache_bits(want), atol=0, rtol=0, equal_nan=True)
    assert torch.equal(qkv, qkv_before), "rotary_store_kv must not modify its inputs"


@cache_params
def test_the_dispatch_runs_the_reference_on_cpu_and_agrees(cache_dtype):
    """kernels.rotary_store_kv on CPU tensors is the torch reference (the two references composed); the kernel
    under the interpreter matches it (bf16 roundings may differ by a unit in the last place)."""
    if DEVICE.type != "cpu":
        pytest.skip("the CPU dispatch")
    gen = torch.Generator().manual_seed(11)
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    qkv = fused_qkv(3, num_heads, num_kv_heads, head_dim, torch.float32, gen)
    cos, sin = cos_sin("mrope", 3, head_dim, gen)
    slots = torch.tensor([5, 0, 17])
    q, k, v, _ = split(qkv, num_heads, num_kv_heads, head_dim)
    expected, actual = (new_caches(cache_dtype, torch.float32, num_kv_heads, head_dim) for _ in range(2))
    q_ref = kernels.rotary_store_kv(q, k, v, cos, sin, *expected[:2], slots, k_scale=expected[2], v_scale=expected[3])
    q_out = rotary_store_kv(q, k, v, cos, sin, *actual[:2], slots, k_scale=actual[2], v_scale=actual[3])
    torch.testing.assert_close(q_out, q_ref, atol=0, rtol=0)
    for want, got in zip(expected, actual, strict=True):
        if want is not None:
            torch.testing.assert_close(cache_bits(got), cache_bits(want), atol=0, rtol=0, equal_nan=True)


def test_no_tokens_is_a_no_op():
    k_cache, v_cache, _, _ = new_caches(None, torch.float16, 2, 16)
    empty = torch.zeros(0, 2, 16, dtype=torch.float16, device=DEVICE)
    table = torch.zeros(0, 8, device=DEVICE)
    no_slots = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    q = rotary_store_kv(empty, empty, empty, table, table, k_cache, v_cache, no_slots)
    assert q.shape == (0, 2, 16) and (k_cache == 7).all() and (v_cache == 7).all()


def test_rejects_mismatched_operands():
    gen = torch.Generator().manual_seed(2)
    qkv = fused_qkv(3, 4, 2, 16, torch.float32, gen)
    q, k, v, _ = split(qkv, 4, 2, 16)
    cos, sin = cos_sin("rope", 3, 16, gen)
    k_cache, v_cache, _, _ = new_caches(None, torch.float32, 2, 16)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(AssertionError, match="k:"):  # 2 KV heads in k, 3 in the caches
        rotary_store_kv(q, k, v, cos, sin, *new_caches(None, torch.float32, 3, 16)[:2], slots)
    with pytest.raises(AssertionError, match="q .* and k .* differ"):
        rotary_store_kv(q, k.half(), v, cos, sin, k_cache, v_cache, slots)
    with pytest.raises(AssertionError, match="cos:"):
        rotary_store_kv(q, k, v, cos[:2], sin[:2], k_cache, v_cache, slots)
