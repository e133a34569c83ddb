"""Reading a quantized checkpoint's scale tensors into `Fp8Linear`: which tensors are scales, and each rank's part
of them.

Scales are kept per weight row (language/quant/fp8.py), so the slices the loader takes of weight rows (a rank's
heads, a fused layer's pieces) apply to them unchanged once a block-wise checkpoint's [ceil(N / 128), G] scales are
repeated over their rows. A row-parallel layer (o_proj, down_proj) splits its input columns: that is whole 128-column
groups of a block-wise scale, and nothing of a per-channel one, which stays whole."""

from __future__ import annotations

import torch

from language.quant.fp8 import expand_block_scales
from language.quant.scheme import QuantScheme

SCALE_NAMES = ("weight_scale", "weight_scale_inv")


def is_scale(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in SCALE_NAMES


class ScaleView:
    """A scale tensor not read yet, indexed as its weight would be: `view[rows]` (output rows) or
    `view[:, columns]` (input columns). Scales are small: the whole tensor is read, then sliced."""

    def __init__(self, view, scheme: QuantScheme) -> None:
        self.view, self.scheme = view, scheme

    def __getitem__(self, index) -> torch.Tensor:
        scales = self.view[:].float()
        if scales.dim() == 1:  # a per-channel scale stored as [N]
            scales = scales[:, None]
        if self.scheme.block is not None:
            scales = expand_block_scales(scales, self.scheme.block[0])
        rows, columns = index if isinstance(index, tuple) else (index, slice(None))
        return scales[rows][:, self._groups(columns)]

    def _groups(self, columns: slice) -> slice:
        if columns == slice(None) or self.scheme.block is None:
            return slice(None)  # per channel: every input column shares the row's scale
        width = self.scheme.block[1]
        if columns.start % width:  # each rank's start aligned: so is the stop of every rank but the last
            raise ValueError(
                f"a row-parallel slice of input columns {columns.start}:{columns.stop} cuts the checkpoint's "
                f"{width}-column scale blocks; use a --tp whose per-rank width is a multiple of {width}"
            )
        return slice(columns.start // width, -(-columns.stop // width))


def fit_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A scale tensor expanded from 128-row blocks may run past its weight's last row: keep `rows`."""
    return tensor[:rows]
