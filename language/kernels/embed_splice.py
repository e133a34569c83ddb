"""Splice multimodal embeddings (image features) into the prompt's token embeddings at their placeholder rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from language.kernels.launch_utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_device,
    check_dtype,
    check_inner_contiguous,
    check_shape,
)

_BLOCK = 1024


@triton.jit
def _splice_embeddings_kernel(
    inputs_embeds_ptr,  # [N, H]
    mm_embeds_ptr,  # [M, H]
    mm_positions_ptr,  # [M]
    stride_inputs,
    stride_mm,
    hidden,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    dst_row = tl.load(mm_positions_ptr + row).to(tl.int64)
    values = tl.load(mm_embeds_ptr + row * stride_mm + offs, mask=mask)
    dst = inputs_embeds_ptr + dst_row * stride_inputs + offs
    tl.store(dst, values.to(inputs_embeds_ptr.dtype.element_ty), mask=mask)


def splice_embeddings(inputs_embeds: torch.Tensor, mm_embeds: torch.Tensor, mm_positions: torch.Tensor) -> None:
    """inputs_embeds: [N, H]; mm_embeds: [M, H]; mm_positions: [M] (distinct rows of inputs_embeds) ->
    inputs_embeds[mm_positions] = mm_embeds, in place, cast to inputs_embeds' dtype."""
    check_device(inputs_embeds=inputs_embeds, mm_embeds=mm_embeds, mm_positions=mm_positions)
    check_dtype("inputs_embeds", inputs_embeds, FLOAT_DTYPES)
    check_dtype("mm_embeds", mm_embeds, FLOAT_DTYPES)
    check_dtype("mm_positions", mm_positions, INDEX_DTYPES)
    check_shape("inputs_embeds", inputs_embeds, (None, None))
    hidden = inputs_embeds.shape[1]
    check_shape("mm_embeds", mm_embeds, (None, hidden))
    num_rows = mm_embeds.shape[0]
    check_shape("mm_positions", mm_positions, (num_rows,))
    check_inner_contiguous("inputs_embeds", inputs_embeds)
    check_inner_contiguous("mm_embeds", mm_embeds)
    if num_rows == 0:
        return
    mm_positions = mm_positions.contiguous()
    grid = (num_rows, cdiv(hidden, _BLOCK))
    _splice_embeddings_kernel[grid](
        inputs_embeds, mm_embeds, mm_positions, inputs_embeds.stride(0), mm_embeds.stride(0), hidden,
        BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
