"""Shared inputs and checks for the kernel tests: the device under test, per-dtype tolerances, NaN poisoning, and
ragged batches whose K/V live in scattered token slots of a cache."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

# Kernels run on the GPU when there is one (the real kernels), else on CPU under TRITON_INTERPRET=1 (conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
dtype_params = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))

# (atol, rtol). Elementwise kernels mirror the reference's roundings, so they agree to about one unit in the last
# place (the interpreter may round bf16 differently); attention also rounds the softmax weights to the input dtype
# before the P @ V product, as every flash kernel does.
ELEMENTWISE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
ATTENTION_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2.5e-2, 2.5e-2)}


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An output buffer full of NaN, so a row the kernel forgets to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_written_and_close(actual: torch.Tensor, expected: torch.Tensor, tol: dict) -> None:
    assert not actual.isnan().any(), f"{int(actual.isnan().sum())} output values left unwritten (NaN)"
    atol, rtol = tol[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def strided_view(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """The same values as `t` ([N, ...]) in a view whose rows are `pad` elements further apart than contiguous, like
    q/k/v split out of a fused qkv projection."""
    flat = t.reshape(t.shape[0], -1)
    wide = torch.zeros(t.shape[0], flat.shape[1] + pad, dtype=t.dtype, device=t.device)
    wide[:, : flat.shape[1]] = flat
    return wide[:, : flat.shape[1]].view(t.shape)


@dataclass
class RaggedBatch:
    """Sequences whose tokens sit in scattered slots of a KV cache, addressed through a request-to-token table."""

    k_cache: torch.Tensor  # [S, Hk, D]
    v_cache: torch.Tensor  # [S, Hk, D]
    req_to_token: torch.Tensor  # [R, L] int32
    b_req_idx: torch.Tensor  # [B] int32
    b_seq_len: torch.Tensor  # [B] int32


def ragged_batch(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, generator: torch.Generator
) -> RaggedBatch:
    total = sum(seq_lens)
    pool = total + 11  # spare slots that no sequence owns
    slots = torch.randperm(pool, generator=generator)[:total]  # scattered, not one contiguous run
    num_reqs = len(seq_lens) + 2
    req_rows = torch.randperm(num_reqs, generator=generator)[: len(seq_lens)]  # batch order != table order
    req_to_token = torch.zeros(num_reqs, max(seq_lens) + 5, dtype=torch.int32)
    offset = 0
    for row, seq_len in zip(req_rows.tolist(), seq_lens, strict=True):
        req_to_token[row, :seq_len] = slots[offset : offset + seq_len].int()
        offset += seq_len
    cache_shape = (pool, num_kv_heads, head_dim)
    return RaggedBatch(
        k_cache=torch.randn(cache_shape, generator=generator).to(dtype).to(DEVICE),
        v_cache=torch.randn(cache_shape, generator=generator).to(dtype).to(DEVICE),
        req_to_token=req_to_token.to(DEVICE),
        b_req_idx=req_rows.int().to(DEVICE),
        b_seq_len=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    )


def randn(*shape: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
