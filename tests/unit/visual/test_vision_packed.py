"""Qwen2-VL's packed vision attention: the host-built index equals transformers' own, the tower with our layers
equals HF's eager and sdpa towers, each block's attention gets the whole batch in one call, each residual add runs
fused with the norm after it, and the varlen kernel is called right whatever its signature (checked on CPU against a
reference varlen attention)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
from visual import kernels
from visual.attention_backend import set_vit_att_backend, vit_att_backend
from visual.models.fused_layers import LinearPatchEmbed, PackedVisionAttention, QuickGELU
from visual.models.fused_norms import AddNormBlock, HandoffLayerNorm
from visual.models.packed_attention import call_varlen, can_use_varlen, dense_attention, pack_index, sdpa_per_segment
from visual.models.qwen2_vl import Qwen2VLVisionModel
from visual.staging import HostStaging

CPU = torch.device("cpu")
GRIDS = [(1, 4, 6), (1, 8, 8), (2, 2, 4), (1, 10, 2)]  # (t, h, w) patch grids; t=2: two frames, two segments
SIZES = [(150, 100), (60, 200), (333, 77), (56, 56)]  # (width, height) of test images: four different grids


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_qwen2_vl(str(tmp_path_factory.mktemp("qwen2_vl")))


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_pack_index_equals_transformers() -> None:
    index = pack_index(GRIDS, merge_size=2)
    grid = torch.tensor(GRIDS)
    assert index.cu_seqlens.dtype == torch.int32
    assert torch.equal(index.cu_seqlens, get_vision_cu_seqlens(grid))
    assert index.cu_seqlens.tolist() == [0, 24, 88, 96, 104, 124]
    assert index.max_seqlen == 64
    assert torch.equal(index.position_ids, get_vision_position_ids(grid, 2))


def _hf_tower(model_dir: str, attn: str) -> Qwen2VisionTransformerPretrainedModel:
    """HF's own tower with HF's attention, loaded with the same weights as ours."""
    ours = Qwen2VLVisionModel.from_pretrained(model_dir, CPU, torch.float32)
    config = copy.deepcopy(ours.tower.config)
    config._attn_implementation = attn  # the tower's config names ours
    tower = Qwen2VisionTransformerPretrainedModel._from_config(config, dtype=torch.float32)
    tower.load_state_dict(ours.tower.state_dict())
    return tower.eval()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_tower_equals_hf(model_dir: str, attn: str) -> None:
    vision = Qwen2VLVisionModel.from_pretrained(model_dir, CPU, torch.float32)
    assert all(isinstance(b.attn, PackedVisionAttention) for b in vision.tower.blocks)
    assert all(isinstance(b.mlp.act, QuickGELU) for b in vision.tower.blocks)
    assert isinstance(vision.tower.patch_embed, LinearPatchEmbed)
    assert all(isinstance(b, AddNormBlock) for b in vision.tower.blocks)
    assert isinstance(vision.tower.merger.ln_q, HandoffLayerNorm)
    pils = [_image(w, h, i) for i, (w, h) in enumerate(SIZES)]
    images = [vision.preprocess(pil) for pil in pils]
    assert len({im.grid_thw for im in images}) == len(images)
    ours = vision.encode(images)
    hf = _hf_tower(model_dir, attn)
    hf_inputs = vision.processor(images=pils, return_tensors="pt")  # transformers' processor, in one call
    with torch.inference_mode():
        theirs = hf(hf_inputs["pixel_values"], grid_thw=hf_inputs["image_grid_thw"]).pooler_output
    torch.testing.assert_close(torch.cat(ours), theirs, rtol=1e-5, atol=1e-5)
    assert [e.shape[0] for e in ours] == [im.num_tokens for im in images]


def test_each_block_attends_the_whole_batch_once(model_dir: str) -> None:
    """The design rests on one attention call per block with every image packed, the host-built cu_seqlens and
    max_seqlen (no device-side recomputation, no sync): watch the calls each block's attention receives."""
    vision = Qwen2VLVisionModel.from_pretrained(model_dir, CPU, torch.float32)
    calls: list[tuple[int, list[int], int | None]] = []

    def watch(module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        calls.append((hidden.shape[0], kwargs["cu_seqlens"].tolist(), kwargs.get("max_seqlen")))

    for block in vision.tower.blocks:
        block.attn.register_forward_pre_hook(watch, with_kwargs=True)
    images = [vision.preprocess(_image(w, h, i)) for i, (w, h) in enumerate(SIZES)]
    vision.encode(images)
    index = pack_index([im.grid_thw for im in images], vision.merge_size)
    patches = sum(im.patches for im in images)
    assert calls == [(patches, index.cu_seqlens.tolist(), index.max_seqlen)] * len(vision.tower.blocks)


def test_each_residual_add_runs_with_the_norm_after_it(model_dir: str, monkeypatch) -> None:
    """Every add but none is fused: two fused add + norm calls per block, the only standalone norm the first block's
    `norm1`, and the merger normalises nothing itself but takes the last block's fused output."""
    vision = Qwen2VLVisionModel.from_pretrained(model_dir, CPU, torch.float32)
    tower = vision.tower
    fused_outputs: list[torch.Tensor] = []

    def counted(*args, **kwargs):
        h, normed = fused(*args, **kwargs)
        fused_outputs.append(normed)
        return h, normed

    fused = kernels.add_layer_norm
    monkeypatch.setattr(kernels, "add_layer_norm", counted)
    norm_calls: list[str] = []
    for i, block in enumerate(tower.blocks):
        for name in ("norm1", "norm2"):
            getattr(block, name).register_forward_hook(lambda *_, n=f"{i}.{name}": norm_calls.append(n))
    merger_norm: list[torch.Tensor] = []
    tower.merger.ln_q.register_forward_hook(lambda _m, _a, out: merger_norm.append(out))
    vision.encode([vision.preprocess(_image(w, h, i)) for i, (w, h) in enumerate(SIZES)])
    assert len(fused_outputs) == 2 * len(tower.blocks)
    assert norm_calls == ["0.norm1"]
    assert len(merger_norm) == 1 and merger_norm[0].data_ptr() == fused_outputs[-1].data_ptr()  # not recomputed


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None) -> torch.Tensor:
    """Varlen attention from its definition, in one call: a block-diagonal mask from the segment ids."""
    tokens = torch.arange(q.shape[0])
    seg_q = torch.searchsorted(cu_q[1:], tokens, right=True)
    seg_k = torch.searchsorted(cu_k[1:], tokens, right=True)
    mask = seg_q[:, None] == seg_k[None, :]  # [tokens, tokens]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale=scale)
    return out.transpose(0, 1)  # [tokens, heads, head_dim]


def varlen_torch_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.9's signature: no scale (always 1/sqrt(head_dim)), `is_causal`."""
    assert not is_causal
    return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)


def varlen_torch_later(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                       window_size=(-1, -1)):  # fmt: skip
    """Later signatures: keyword-only `scale` and `window_size`; may return (out, lse)."""
    assert window_size == (-1, -1)
    out = reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale)
    return out, torch.zeros(out.shape[:2])


@pytest.mark.parametrize("kernel", [varlen_torch_2_9, varlen_torch_later], ids=["torch2.9", "later"])
@pytest.mark.parametrize("scale", [16**-0.5, 0.3], ids=["default_scale", "other_scale"])
def test_call_varlen_adapts_to_the_signature(kernel, scale: float) -> None:
    g = torch.Generator().manual_seed(0)
    cu = pack_index(GRIDS, merge_size=2).cu_seqlens
    q, k, v = (torch.randn(int(cu[-1]), 2, 16, generator=g) for _ in range(3))  # [tokens, heads, head_dim]
    out = call_varlen(kernel, q, k, v, cu, int((cu[1:] - cu[:-1]).max()), scale)
    expected = sdpa_per_segment(*(t.transpose(0, 1)[None] for t in (q, k, v)), cu, scale)[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    if not math.isclose(scale, 16**-0.5):  # the scale matters here, so a dropped one would fail the check above
        default = sdpa_per_segment(*(t.transpose(0, 1)[None] for t in (q, k, v)), cu, 16**-0.5)[0]
        assert not torch.allclose(expected, default, atol=1e-3)


def test_dense_attention_equals_per_segment_attention() -> None:
    """Segments of one length (a batch of one image size) run as one dense batch: each still attends to itself."""
    g = torch.Generator().manual_seed(3)
    cu = pack_index([(1, 4, 6)] * 3 + [(2, 4, 6)], merge_size=2).cu_seqlens  # five frames of 24 patches
    q, k, v = (torch.randn(int(cu[-1]), 2, 16, generator=g) for _ in range(3))  # [tokens, heads, head_dim]
    out = dense_attention(q, k, v, segments=5, scale=0.3)
    expected = sdpa_per_segment(*(t.transpose(0, 1)[None] for t in (q, k, v)), cu, 0.3)[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    one_sequence = sdpa_per_segment(*(t.transpose(0, 1)[None] for t in (q, k, v)), cu[[0, -1]], 0.3)[0]
    assert not torch.allclose(out, one_sequence, atol=1e-3)  # the segments are really kept apart


def test_varlen_only_where_flash_runs() -> None:
    q = torch.zeros(4, 2, 16)
    assert not can_use_varlen(q, varlen_torch_later)  # CPU
    assert not can_use_varlen(q, None)
    if torch.cuda.is_available():
        assert can_use_varlen(q.cuda().half(), varlen_torch_later)
        assert not can_use_varlen(q.cuda(), varlen_torch_later)  # fp32
        assert not can_use_varlen(torch.zeros(4, 2, 12, device="cuda", dtype=torch.half), varlen_torch_later)


def test_our_attention_where_it_applies() -> None:
    """The towers send our packed attention every batch at least a query tile long whose head dim splits, of one
    image size or ragged; Qwen2.5-VL's windows, Qwen3-VL's head dim and `--vit_att_backend sdpa` go to flash."""
    ours = PackedVisionAttention._ours
    q = torch.empty(4 * 4096, 16, 80, device="meta")
    assert ours(4096, q) and ours(576, torch.empty(16 * 576, 16, 80, device="meta"))  # 896 px, 336 px
    assert ours(4096, q[: 4096 + 576])  # two sizes
    assert ours(200, torch.empty(600, 16, 80, device="meta"))  # each image ends inside a key tile
    assert not ours(64, torch.empty(64 * 64, 16, 80, device="meta"))  # Qwen2.5-VL's windows: half a query tile
    assert not ours(4096, torch.empty(4 * 4096, 16, 72, device="meta"))  # Qwen3-VL's head dim does not split
    try:
        set_vit_att_backend("sdpa")
        assert not ours(4096, q)
        set_vit_att_backend("fa3")  # not bundled: auto
        assert vit_att_backend() == "auto" and ours(4096, q)
    finally:
        set_vit_att_backend("auto")
    with pytest.raises(ValueError, match="vit_att_backend"):
        set_vit_att_backend("flash")


def test_host_staging_reuses_its_buffer() -> None:
    staging = HostStaging()
    a = staging.take((4, 3), torch.float32, CPU)
    b = staging.take((2, 3), torch.float32, CPU)
    assert b.data_ptr() == a.data_ptr()  # smaller: the same memory
    c = staging.take((64, 3), torch.bfloat16, CPU)
    assert c.shape == (64, 3) and c.dtype == torch.bfloat16
    parts = [torch.randn(3, 5), torch.randn(2, 5)]
    torch.testing.assert_close(staging.cat(parts, CPU), torch.cat(parts))
    if torch.cuda.is_available():
        pinned = staging.cat(parts, torch.device("cuda"))
        assert pinned.is_pinned()
        torch.testing.assert_close(pinned, torch.cat(parts))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels and flash attention need a GPU")
@pytest.mark.parametrize(
    "sizes",
    [SIZES, [(112, 84)] * 3, [(224, 224)] * 3],  # mixed: ours, ragged; 48 patches each: flash; 256 each: ours
    ids=["mixed_sizes_ours", "one_size_dense", "one_size_ours"],
)
def test_fused_tower_on_gpu_is_close_to_hf(model_dir: str, sizes: list[tuple[int, int]]) -> None:
    """bf16 on CUDA: our kernels (qkv + rotary, QuickGELU, the patch GEMM) and the varlen / dense flash attention or
    our packed attention against transformers' own tower with sdpa attention, within bf16 tolerance."""
    cuda = torch.device("cuda")
    vision = Qwen2VLVisionModel.from_pretrained(model_dir, cuda, torch.bfloat16)
    pils = [_image(w, h, i) for i, (w, h) in enumerate(sizes)]
    images = [vision.preprocess(pil) for pil in pils]
    ours = torch.cat(vision.encode(images)).float()
    config = copy.deepcopy(vision.tower.config)
    config._attn_implementation = "sdpa"
    with torch.device(cuda):
        hf = Qwen2VisionTransformerPretrainedModel._from_config(config, dtype=torch.bfloat16).eval()
    hf.load_state_dict(vision.tower.state_dict())
    with torch.inference_mode():
        pixels = vision.processor(images=pils, return_tensors="pt")["pixel_values"].to(cuda)  # HF's, on the CPU
        grid = torch.tensor([im.grid_thw for im in images], device=cuda)  # HF builds its rotary ids on its device
        theirs = hf(pixels, grid_thw=grid).pooler_output.float()
    err = (ours - theirs).abs().mean() / theirs.abs().mean()
    assert err < 2e-2, f"relative mean error {err:.4f}"
    assert F.cosine_similarity(ours, theirs, dim=-1).min() > 0.99
