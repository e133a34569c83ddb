"""FP8 serving against HF transformers on the unquantized weights, under the fidelity rule of quantized serving
(mmserve/testing/fidelity.py: at the first divergence of the greedy tokens, each side's token is in the other's top
5): weights quantized at load (`--quant_type fp8w8a8`), a checkpoint in the Qwen3-VL-*-FP8 layout (128x128 block
scales) and one in compressed-tensors' FP8-dynamic layout, each on prompts with an image and without.

Random weights give nearly flat logits, closer than FP8's noise; the checkpoint's token embeddings are scaled up x4
here, so that the residual stream carries each token's own embedding above the layers' (quantized) contributions
and the greedy choices have margins. The published-layout loading is also checked directly: the engine's FP8 layers
hold exactly the checkpoint's e4m3 values and scales, fused and split between tensor-parallel ranks."""

from __future__ import annotations

import glob
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor

from language.request import MultimodalItem
from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from mmserve.testing.checkpoints.fp8 import dequantize_block, quantize_checkpoint, scale_embeddings
from mmserve.testing.checkpoints.qwen3_vl import build_qwen3_vl
from mmserve.testing.fidelity import TOP_K, check_top_k_rule, engine_top_k, first_divergence
from tests.models.qwen_vl_harness import CHAT, VISION, QwenVLFamily, random_image
from visual.models.base import vision_model_class

ARCH = "Qwen3VLForConditionalGeneration"
FAMILY = QwenVLFamily("qwen3_vl", ARCH, build_qwen3_vl, Qwen3VLForConditionalGeneration, Qwen3VLProcessor,
                      Qwen3VLVideoProcessor)  # fmt: skip
EMBED_GAIN = 4.0
NEW_TOKENS = 24
PROMPTS = [
    (CHAT.format(VISION + "Describe this picture."), [(150, 100, 1)]),
    (CHAT.format("What is AI?"), []),
    (CHAT.format("Name three colours of the sea."), []),
]


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> str:
    model_dir = build_qwen3_vl(str(tmp_path_factory.mktemp("qwen3_vl_sharp")))
    return scale_embeddings(model_dir, EMBED_GAIN)


def _fp8_copy(bf16_dir: str, tmp_path_factory, fmt: str) -> str:
    model_dir = str(tmp_path_factory.mktemp(f"qwen3_vl_fp8_{fmt}"))
    shutil.copytree(bf16_dir, model_dir, dirs_exist_ok=True)
    return quantize_checkpoint(model_dir, fmt)


@pytest.fixture(scope="module")
def block_dir(bf16_dir, tmp_path_factory) -> str:
    return _fp8_copy(bf16_dir, tmp_path_factory, "block")


@pytest.fixture(scope="module")
def channel_dir(bf16_dir, tmp_path_factory) -> str:
    return _fp8_copy(bf16_dir, tmp_path_factory, "channel")


@pytest.fixture(scope="module")
def hf_model(bf16_dir):
    return FAMILY.hf_model(bf16_dir)


@pytest.fixture(scope="module")
def cases(bf16_dir):
    """(prompt ids, our multimodal items, HF's processor inputs besides input_ids) per prompt."""
    from mmserve.prep.multimodal.prompt import prompt_processor_class

    processor = FAMILY.hf_processor(bf16_dir)
    prompter = prompt_processor_class(ARCH).from_pretrained(bf16_dir, processor.tokenizer)
    vision = vision_model_class(ARCH).from_pretrained(bf16_dir, torch.device("cpu"), torch.float32)
    out = []
    for text, sizes in PROMPTS:
        images = [random_image(w, h, seed) for w, h, seed in sizes]
        mm = prompter.encode(text, [im.size for im in images])
        embeds = vision.encode([vision.preprocess(im) for im in images]) if images else []
        placed = zip(mm.offsets, embeds, mm.grid_thw, strict=True)
        items = [MultimodalItem(offset=o, embeds=e, grid_thw=g) for o, e, g in placed]
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == mm.token_ids
        out.append((mm.token_ids, items, {k: v for k, v in inputs.items() if k != "input_ids"}))
    return out


def _hf_greedy_and_top(hf_model, prompt: list[int], extra: dict) -> tuple[list[int], list[list[int]]]:
    """HF's greedy tokens and, at each step, its top-k next tokens."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
            return_dict_in_generate=True, eos_token_id=None, **extra,
        )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [s[0].topk(TOP_K).indices.tolist() for s in out.scores]


def _check_follows_hf(llm: LLM, hf_model, cases) -> list[int]:
    """The fidelity rule on every case; returns how many tokens each agreed on before diverging."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    ours = llm.generate([p for p, _, _ in cases], params, mm_items=[items for _, items, _ in cases])
    return [
        _check_case(llm, hf_model, case, gen.token_ids, n)
        for n, (case, gen) in enumerate(zip(cases, ours, strict=True))
    ]


def _check_case(llm: LLM, hf_model, case, ours: list[int], n: int) -> int:
    prompt, items, extra = case
    theirs, their_tops = _hf_greedy_and_top(hf_model, prompt, extra)
    broken = check_top_k_rule(
        ours, theirs, lambda i: engine_top_k(llm, prompt + theirs[:i], items), lambda i: their_tops[i]
    )
    assert broken is None, f"case {n}: {broken}"
    i = first_divergence(ours, theirs)
    return NEW_TOKENS if i is None else i


def checkpoint_tensor(model_dir: str, name: str) -> torch.Tensor:
    for path in glob.glob(f"{model_dir}/*.safetensors"):
        tensors = load_file(path)
        if name in tensors:
            return tensors[name]
    raise KeyError(name)


def check_fp8_head(model, table: torch.Tensor) -> None:
    """The LM head holds `table` (the checkpoint's head, or its tied embedding) in e4m3 per row, and its logits are
    the torch reference of that quantized arithmetic: x per token, the table per row, both in e4m3."""
    from language.quant.fp8 import fp8_linear_ref, quantize_weight
    from language.quant.head import Fp8LMHead

    head = model.lm_head
    assert isinstance(head, Fp8LMHead) and head.weight.dtype == torch.float8_e4m3fn
    q, scales = quantize_weight(table)
    assert torch.equal(head.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(head.weight_scale, scales)
    x = torch.randn(3, table.shape[1], generator=torch.Generator().manual_seed(0)) * 2
    torch.testing.assert_close(head(x), fp8_linear_ref(x, q, scales), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quant_lm_head", [False, True], ids=["bf16_head", "fp8_head"])
def test_fp8w8a8_quantized_at_load_follows_hf(bf16_dir, hf_model, cases, quant_lm_head):
    llm = LLM(bf16_dir, max_total_token_num=2048, device="cpu", quant_type="fp8w8a8", chunked_prefill_size=16,
              quant_lm_head=quant_lm_head)  # fmt: skip
    model = llm.engine.runner.model
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.down_proj.weight_scale.shape == (layer.mlp.down_proj.out_features, 1)
    if quant_lm_head:
        check_fp8_head(model, checkpoint_tensor(bf16_dir, "lm_head.weight"))  # untied: the head's own weight
    else:  # the default: the head as written
        assert torch.equal(model.lm_head.weight, checkpoint_tensor(bf16_dir, "lm_head.weight"))
    assert model.embed_tokens.weight.dtype == torch.float32
    agreed = _check_follows_hf(llm, hf_model, cases)
    print("tokens agreed before the first divergence:", agreed)
    assert sum(agreed) >= NEW_TOKENS * len(cases) // 2, agreed


@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_fp8_checkpoint_follows_hf(fmt, request, hf_model, cases):
    model_dir = request.getfixturevalue(f"{fmt}_dir")
    llm = LLM(model_dir, max_total_token_num=2048, device="cpu")  # no flag: the checkpoint says FP8
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn
    head = llm.engine.runner.model.lm_head  # as published: unquantized
    assert torch.equal(head.weight, checkpoint_tensor(model_dir, "lm_head.weight"))
    agreed = _check_follows_hf(llm, hf_model, cases)
    print("tokens agreed before the first divergence:", agreed)
    assert sum(agreed) >= NEW_TOKENS * len(cases) // 2, agreed


def test_block_checkpoint_loads_as_published(block_dir):
    """The fused q/k/v layer holds the checkpoint's e4m3 q, k and v rows, and its per-row scales dequantize them to
    exactly what the 128x128 block scales do; each of two tensor-parallel ranks reads its heads' rows and scales."""
    from language.config import EngineConfig
    from language.model_builder import model_config
    from language.parallel.sharding import make_shard, take
    from language.quant.fp8 import dequantize
    from language.quant.loading import ScaleView
    from language.quant.scheme import quant_scheme

    tensors = {}
    for path in glob.glob(f"{block_dir}/*.safetensors"):
        tensors.update(load_file(path))
    prefix = "model.language_model.layers.1.self_attn."
    full = {p: dequantize_block(tensors[f"{prefix}{p}_proj.weight"], tensors[f"{prefix}{p}_proj.weight_scale_inv"])
            for p in "qkvo"}  # fmt: skip
    llm = LLM(block_dir, max_total_token_num=256, device="cpu")
    attn = llm.engine.runner.model.layers[1].self_attn
    assert torch.equal(dequantize(attn.qkv_proj.weight, attn.qkv_proj.weight_scale_inv),
                       torch.cat([full["q"], full["k"], full["v"]]))  # fmt: skip
    assert torch.equal(dequantize(attn.o_proj.weight, attn.o_proj.weight_scale_inv), full["o"])

    _, raw, lm_cfg = model_config(EngineConfig(model_dir=block_dir))
    scheme, d, name = quant_scheme("none", raw), lm_cfg.head_dim, f"{prefix}q_proj."
    for rank in range(2):
        shard = make_shard(lm_cfg, rank, 2)
        q = take(shard, "qkv_proj", 0, tensors[name + "weight"])
        scales = take(shard, "qkv_proj", 0, ScaleView(tensors[name + "weight_scale_inv"], scheme))
        assert torch.equal(dequantize(q, scales), full["q"][shard.head0 * d : (shard.head0 + shard.heads) * d])
    # o_proj's input columns split between the ranks: 64 each, inside one 128-column scale block
    with pytest.raises(ValueError, match="128-column scale blocks"):
        take(make_shard(lm_cfg, 1, 2), "o_proj", None, ScaleView(tensors[f"{prefix}o_proj.weight_scale_inv"], scheme))


def test_fp8_vision_tower_stays_close_to_its_bf16_self(bf16_dir):
    """--vit_quant_type fp8w8a8: the encoder layers' linears swapped (3 blocks x qkv, proj, fc1, fc2), the mergers
    not; the image embeddings move by FP8's noise only."""
    from visual.models.fp8_linear import Fp8TowerLinear, quantize_tower

    vision = vision_model_class(ARCH).from_pretrained(bf16_dir, torch.device("cpu"), torch.float32)
    image = vision.preprocess(random_image(150, 100, 1))
    before = vision.encode([image])[0]
    assert quantize_tower(vision.tower) == 12
    assert not any(isinstance(m, Fp8TowerLinear) for m in vision.tower.merger.modules())
    after = vision.encode([image])[0]
    rel = (after - before).norm() / before.norm()
    assert 0 < rel < 0.1, rel


def test_fp8_qwen2_vl_tower_takes_pixels_in_its_own_dtype(tmp_path):
    """--vit_quant_type fp8w8a8 on Qwen2-VL, whose blocks' linears become FP8: the pixels still reach the patch
    embedding in the tower's dtype, not cast to e4m3 (the dtype of a block's weight) on the way."""
    from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
    from visual.models.fp8_linear import quantize_tower

    vision = vision_model_class("Qwen2VLForConditionalGeneration").from_pretrained(
        build_qwen2_vl(str(tmp_path / "q2")), torch.device("cpu"), torch.float32
    )
    quantize_tower(vision.tower)
    seen = []
    vision.tower.patch_embed.register_forward_hook(lambda _m, args, _out: seen.append(args[0].dtype))
    vision.encode([vision.preprocess(random_image(150, 100, 1))])
    assert seen == [torch.float32]


def test_block_fp8_tower_weights_are_dequantized_at_load(bf16_dir, tmp_path):
    """A checkpoint whose tower linears are block-wise FP8 too (not left out by modules_to_not_convert): the tower
    loads them dequantized, and its embeddings stay within FP8's noise of the unquantized tower's."""
    from safetensors.torch import save_file

    from mmserve.testing.checkpoints.fp8 import quantize_block

    model_dir = str(tmp_path / "tower_fp8")
    shutil.copytree(bf16_dir, model_dir)
    for path in glob.glob(f"{model_dir}/*.safetensors"):
        tensors = load_file(path)
        for name in [n for n in tensors if n.startswith("model.visual.blocks.") and n.endswith("fc1.weight")]:
            tensors[name], tensors[name + "_scale_inv"] = quantize_block(tensors[name])
        save_file(tensors, path, metadata={"format": "pt"})
    image = random_image(150, 100, 1)
    embeds = []
    for d in (bf16_dir, model_dir):
        vision = vision_model_class(ARCH).from_pretrained(d, torch.device("cpu"), torch.float32)
        embeds.append(vision.encode([vision.preprocess(image)])[0])
    rel = (embeds[1] - embeds[0]).norm() / embeds[0].norm()
    assert 0 < rel < 0.05, rel
