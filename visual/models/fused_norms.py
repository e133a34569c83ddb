"""Each residual add of the Qwen2-VL and Qwen3-VL vision towers fused with the LayerNorm that reads its sum
(`visual.kernels.add_layer_norm`): in a block, the add after the attention with the block's `norm2`; the add after
the MLP with the next block's `norm1`, or after the last block with the merger's norm. The sum is written once and
the norm reads it from registers, not from memory again.

transformers' tower loop hands each block only the hidden states, so the add after a block's MLP, which already
normalised them for the next block, leaves that output in a `NormHandoff`; the next block (or the merger's norm)
takes it when the hidden states it is called with are the very tensor handed off, and normalises them itself
otherwise (the first block, or a tower that read or changed them in between). The blocks, norms and merger stay
transformers' modules, with their parameters and names.

On CPU the fused op is the unfused pair (`add_layer_norm_ref`), so the CPU tower equals HF's bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchMerger, Qwen2VLVisionBlock
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionBlock, Qwen3VLVisionPatchMerger

from visual import kernels

# Blocks whose forward is `h = h + attn(norm1(h), ...); h = h + mlp(norm2(h))` with LayerNorms (Qwen2.5-VL's are
# RMSNorms: not these).
_ADD_NORM_BLOCKS = (Qwen2VLVisionBlock, Qwen3VLVisionBlock)


class NormHandoff:
    """One block's normalised hidden states, waiting for the module that would normalise the same tensor again."""

    def __init__(self) -> None:
        self._source: torch.Tensor | None = None
        self._normed: torch.Tensor | None = None

    def give(self, source: torch.Tensor, normed: torch.Tensor) -> None:
        self._source, self._normed = source, normed

    def take(self, source: torch.Tensor) -> torch.Tensor | None:
        """The normalised tensor if `source` is the one handed off, else None; either way nothing is held after."""
        normed = self._normed if source is self._source else None
        self._source = self._normed = None
        return normed


def _add_norm(x: torch.Tensor, y: torch.Tensor, norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, norm(x + y)), in x's shape."""
    width = x.shape[-1]
    h, normed = kernels.add_layer_norm(x.reshape(-1, width), y.reshape(-1, width), norm.weight, norm.bias, norm.eps)
    return h.view(x.shape), normed.view(x.shape)


class AddNormBlock(nn.Module):
    """A Qwen2-VL / Qwen3-VL vision block (its `norm1`, `attn`, `norm2`, `mlp`: the same modules, so the state-dict
    names stay `blocks.N.*`) whose residual adds run fused with the norm after them; `next_norm`: the LayerNorm the
    tower applies next to this block's output (the next block's `norm1`, or the merger's), or None."""

    def __init__(self, block: nn.Module, next_norm: nn.LayerNorm | None, handoff: NormHandoff) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = block.norm1, block.attn, block.norm2, block.mlp
        self._next_norm = (next_norm,)  # not a child: its parameters are named where they belong
        self._handoff = handoff

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        normed = self._handoff.take(hidden_states)
        if normed is None:
            normed = self.norm1(hidden_states)
        attn = self.attn(normed, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings, **kwargs)
        hidden_states, normed = _add_norm(hidden_states, attn, self.norm2)
        mlp = self.mlp(normed)
        next_norm = self._next_norm[0]
        if next_norm is None:
            return hidden_states + mlp
        hidden_states, normed = _add_norm(hidden_states, mlp, next_norm)
        self._handoff.give(hidden_states, normed)
        return hidden_states


class HandoffLayerNorm(nn.Module):
    """A LayerNorm (the same parameters, so its state-dict names stay) that takes the last block's output from the
    handoff when it is called on that block's hidden states."""

    def __init__(self, norm: nn.LayerNorm, handoff: NormHandoff) -> None:
        super().__init__()
        self.weight, self.bias = norm.weight, norm.bias
        self.normalized_shape, self.eps = norm.normalized_shape, norm.eps
        self._handoff = handoff

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self._handoff.take(x)
        if normed is None:
            normed = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return normed


def _merger_norm_name(merger: nn.Module) -> str | None:
    """The attribute of the merger's LayerNorm that it applies to the last block's output as it comes, if any."""
    if type(merger) is PatchMerger:
        return "ln_q"
    if type(merger) is Qwen3VLVisionPatchMerger and not merger.use_postshuffle_norm:
        return "norm"  # a post-shuffle norm reads the merged view: not the block's output as it comes
    return None


def _is_layer_norm(norm: object) -> bool:
    return type(norm) is nn.LayerNorm and norm.elementwise_affine and norm.bias is not None


def use_fused_norms(tower: nn.Module) -> bool:
    """Swap fused-add blocks into a Qwen2-VL or Qwen3-VL tower in place; False (nothing swapped) for other towers."""
    blocks = tower.blocks
    if not all(type(b) in _ADD_NORM_BLOCKS and _is_layer_norm(b.norm1) and _is_layer_norm(b.norm2) for b in blocks):
        return False
    handoff = NormHandoff()
    name = _merger_norm_name(tower.merger)
    merger_norm = getattr(tower.merger, name) if name else None
    last_norm = merger_norm if _is_layer_norm(merger_norm) else None
    next_norms = [b.norm1 for b in list(blocks)[1:]] + [last_norm]
    for i, (block, next_norm) in enumerate(zip(list(blocks), next_norms, strict=True)):
        blocks[i] = AddNormBlock(block, next_norm, handoff)
    if last_norm is not None:
        setattr(tower.merger, name, HandoffLayerNorm(last_norm, handoff))
    return True
