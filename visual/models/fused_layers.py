"""Our layers swapped into transformers' vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), keeping its blocks, its
parameters and their names:

- `PackedVisionAttention` replaces each block's attention: qkv projection, then one kernel that splits q/k/v and
  applies the 2-D rotary (`visual.kernels.qkv_rotary`), then every image of the batch in one attention call: our
  packed kernel (`visual.kernels.varlen_attention`: head dim 80 in two exact parts, where FlashAttention-2 pads it
  to 96; 1.3-1.5x its speed on an H100) for head dims that split so, unless `--vit_att_backend sdpa` asks for
  torch's flash kernel (`packed_attention`), which also takes the rest; then the output projection;
- `QuickGELU` replaces the MLP's QuickGELU (Qwen2-VL) with one kernel;
- `LinearPatchEmbed` runs the patch embedding's Conv3d, whose kernel equals its stride, as the GEMM it is;
- in the LayerNorm towers (Qwen2-VL, Qwen3-VL) each residual add runs fused with the norm after it
  (`visual/models/fused_norms.py`).

On CPU each falls back to transformers' own arithmetic, so the CPU tests compare with HF bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import QuickGELUActivation

from visual import kernels
from visual.attention_backend import our_kernel_allowed
from visual.kernels.varlen_attention import QUERY_TILE, head_dim_parts
from visual.models.fused_norms import use_fused_norms
from visual.models.packed_attention import (
    call_varlen,
    can_use_varlen,
    dense_attention,
    sdpa_per_segment,
    torch_varlen_attn,
)

_HALF = (torch.float16, torch.bfloat16)


class PackedVisionAttention(torch.nn.Module):
    """transformers' vision attention (`qkv`, `proj`, `num_heads`, `scaling`) over a packed batch."""

    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.qkv, self.proj = attn.qkv, attn.proj  # same modules: the state-dict names stay `attn.qkv.*`, `attn.proj.*`
        self.num_heads: int = attn.num_heads
        self.scaling: float = attn.scaling

    def forward(
        self,
        hidden_states: torch.Tensor,  # [tokens, dim]: every image of the batch, packed
        cu_seqlens: torch.Tensor,  # [segments + 1] int32: images, or windows (Qwen2.5-VL)
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [tokens, head_dim], halves equal
        max_seqlen: int | None = None,
        **kwargs,
    ) -> torch.Tensor:  # [tokens, dim]
        num_tokens = hidden_states.shape[0]
        cos, sin = position_embeddings
        q, k, v = kernels.qkv_rotary(self.qkv(hidden_states), cos, sin, self.num_heads)  # each [tokens, H, D]
        kernel = torch_varlen_attn()
        if max_seqlen is None and q.is_cuda:  # the towers pass it; computing it here costs a host sync
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        segments = cu_seqlens.shape[0] - 1
        if q.is_cuda and q.dtype in _HALF and self._ours(max_seqlen, q):
            out = kernels.varlen_attention(q, k, v, cu_seqlens.to(torch.int32), max_seqlen, self.scaling)
        elif can_use_varlen(q, kernel):
            if segments * max_seqlen == num_tokens:  # all of one length (a batch of one image size): dense
                out = dense_attention(q, k, v, segments, self.scaling)
            else:
                out = call_varlen(kernel, q, k, v, cu_seqlens.to(torch.int32), max_seqlen, self.scaling)
        else:  # CPU, fp32: each image through SDPA, as transformers' sdpa path
            heads_major = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # each [1, H, tokens, D]
            out = sdpa_per_segment(*heads_major, cu_seqlens, self.scaling)[0]
        return self.proj(out.reshape(num_tokens, -1))

    @staticmethod
    def _ours(max_seqlen: int, q: torch.Tensor) -> bool:
        """Our kernel where the backend allows it and the head dim splits, for batches of one image size and
        ragged ones alike (both checked on an H100 against per-image SDPA: tests/kernels/test_vision_attention.py,
        benchmarks/tower_bench.py). Segments all shorter than a query tile (Qwen2.5-VL's 64-patch windows) would
        leave half of each tile idle: not timed against flash, so they stay on flash."""
        return our_kernel_allowed() and head_dim_parts(q.shape[-1]) is not None and max_seqlen >= QUERY_TILE


class QuickGELU(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.quick_gelu(x)


class LinearPatchEmbed(torch.nn.Module):
    """transformers' patch embedding (`proj`: a Conv3d with kernel == stride, so one output per patch)."""

    def __init__(self, embed: torch.nn.Module) -> None:
        super().__init__()
        self.proj = embed.proj  # same module: the state-dict name stays `patch_embed.proj.*`

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [patches, C*T*P*P] -> [patches, embed_dim]
        weight = self.proj.weight  # [embed_dim, C, T, P, P]: flattened in the pixels' (C, T, P, P) order
        if pixels.is_cuda:
            return F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1), self.proj.bias)
        # transformers' own forward: the conv over [patches, C, T, P, P]
        return self.proj(pixels.view(-1, *weight.shape[1:]).to(weight.dtype)).view(-1, weight.shape[0])


def use_fused_layers(tower: torch.nn.Module) -> None:
    """Swap our layers into a transformers vision tower in place (after its weights are loaded)."""
    for block in tower.blocks:
        block.attn = PackedVisionAttention(block.attn)
        act = getattr(block.mlp, "act", None)
        if isinstance(act, QuickGELUActivation):
            block.mlp.act = QuickGELU()
    proj = getattr(tower.patch_embed, "proj", None)
    one_per_patch = isinstance(proj, torch.nn.Conv3d) and proj.kernel_size == proj.stride and not any(proj.padding)
    if one_per_patch:
        tower.patch_embed = LinearPatchEmbed(tower.patch_embed)
    use_fused_norms(tower)
