"""Quantized serving of Gemma 3 and InternVL (-hf layout, InternVL3's Qwen2 language model) against HF transformers
on the unquantized weights, under the fidelity rule of quantized serving (mmserve/testing/fidelity.py: at the first
divergence of the greedy tokens, each side's token is in the other's top 5): `--quant_type fp8w8a8` on both, and
`--llm_kv_type int8kv` on InternVL (Gemma 3's is in test_gemma3.py), on prompts with one image, two images and none,
prefilled in 16-token chunks (InternVL's 64- and 112-row images span chunks).

Margins as in test_fp8.py: the token embeddings scaled up x4 (Gemma 3's, written 10x smaller by its builder, x40),
so that greedy choices stand above the quantization noise. Gemma 3's checkpoint gets a head of its own here: with the
published tied head, the scaled embedding of the prompt's last token dominates the logits and every step repeats it
(a test of nothing)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoProcessor, AutoTokenizer, Gemma3ForConditionalGeneration, InternVLForConditionalGeneration

from language.kernels import MeasuredRows, QuantizedRows
from language.kernels.skinny_launches import SKINNY_MAX_ROWS
from language.models.llama import DecoderLayer
from language.quant import linear as linear_module
from language.quant.linear import ONE_PASS_COLUMNS
from language.request import MultimodalItem
from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from mmserve.testing.checkpoints.fp8 import scale_embeddings
from mmserve.testing.checkpoints.gemma3 import build_gemma3
from mmserve.testing.checkpoints.internvl import build_internvl_hf
from mmserve.testing.fidelity import TOP_K, check_top_k_rule, engine_top_k, first_divergence
from tests.models.test_fp8 import check_fp8_head, checkpoint_tensor
from tests.models.test_llava import noise_image
from visual.models.base import vision_model_class
from visual.models.internvl import MIN_TRANSFORMERS

CPU = torch.device("cpu")
EMBED_GAIN = 4.0
NEW_TOKENS = 16
IMAGES = [noise_image(80, 50, 0), noise_image(90, 300, 1)]


@dataclass(frozen=True)
class Family:
    arch: str
    build: Callable[[str], str]
    hf_class: type
    chat: str  # a user turn and the generation prompt, around {}
    image: str  # one image's placeholder in HF's processor's text
    embed_gain: float = EMBED_GAIN  # the builder's embeddings scaled by this


FAMILIES = {
    "gemma3": Family("Gemma3ForConditionalGeneration", lambda out: build_gemma3(out, tied_head=False),
                     Gemma3ForConditionalGeneration, "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n",
                     "<start_of_image>", EMBED_GAIN * 10),  # its builder writes them 10x smaller (tied head)
    "internvl": Family("InternVLForConditionalGeneration", build_internvl_hf, InternVLForConditionalGeneration,
                       "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", "<IMG_CONTEXT>\n"),
}  # fmt: skip


def prompts(family: Family) -> list[tuple[str, list[int]]]:
    """(text, indices into IMAGES) per prompt."""
    return [
        (family.chat.format(family.image + "Describe this picture."), [0]),
        (family.chat.format(family.image * 2 + "Compare the two pictures."), [0, 1]),
        (family.chat.format("What is AI?"), []),
        (family.chat.format("Name three colours of the sea."), []),
    ]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> Family:
    if request.param == "internvl" and Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        pytest.skip(f"InternVL needs transformers >= {MIN_TRANSFORMERS}")
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def model_dir(family, tmp_path_factory) -> str:
    return scale_embeddings(family.build(str(tmp_path_factory.mktemp("sharp") / "m")), family.embed_gain)


@pytest.fixture(scope="module")
def hf_model(family, model_dir):
    return family.hf_class.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cases(family, model_dir):
    """(prompt ids, our multimodal items, HF's processor inputs) per prompt; the prompts equal HF's."""
    from mmserve.prep.multimodal.prompt import prompt_processor_class

    processor = AutoProcessor.from_pretrained(model_dir)
    prompter = prompt_processor_class(family.arch).from_pretrained(model_dir, AutoTokenizer.from_pretrained(model_dir))
    vision = vision_model_class(family.arch).from_pretrained(model_dir, CPU, torch.float32)
    out = []
    for text, image_ids in prompts(family):
        images = [IMAGES[i] for i in image_ids]
        mm = prompter.encode(text, [im.size for im in images])
        embeds = vision.encode([vision.preprocess(im) for im in images]) if images else []
        items = [MultimodalItem(offset=o, embeds=e) for o, e in zip(mm.offsets, embeds, strict=True)]
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == mm.token_ids, text
        out.append((mm.token_ids, items, inputs))
    return out


def hf_greedy_and_top(hf_model, inputs) -> tuple[list[int], list[list[int]]]:
    """HF's greedy tokens (EOS a choice that does not stop it) and, at each step, its top-k next tokens."""
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                                return_dict_in_generate=True, eos_token_id=[], pad_token_id=0, top_k=None,
                                top_p=None)  # fmt: skip
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, [s[0].topk(TOP_K).indices.tolist() for s in out.scores]


def check_follows_hf(llm: LLM, hf_model, cases) -> list[int]:
    """The fidelity rule on every case, all generated in one batch; how many tokens each agreed on first."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    ours = llm.generate([p for p, _, _ in cases], params, mm_items=[items for _, items, _ in cases])
    agreed = []
    for n, ((prompt, items, inputs), gen) in enumerate(zip(cases, ours, strict=True)):
        theirs, their_tops = hf_greedy_and_top(hf_model, inputs)
        our_top = lambda i: engine_top_k(llm, prompt + theirs[:i], items)  # noqa: B023, E731
        broken = check_top_k_rule(gen.token_ids, theirs, our_top, lambda i: their_tops[i])  # noqa: B023
        assert broken is None, f"case {n}: {broken}"
        i = first_divergence(gen.token_ids, theirs)
        agreed.append(NEW_TOKENS if i is None else i)
    print("tokens agreed before the first divergence:", agreed)
    return agreed


def test_fp8w8a8_follows_hf(model_dir, hf_model, cases):
    llm = LLM(model_dir, max_total_token_num=2048, device="cpu", quant_type="fp8w8a8", chunked_prefill_size=16)
    layer = llm.engine.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(llm.engine.runner.model.lm_head.weight, checkpoint_tensor(model_dir, "lm_head.weight"))
    check_layers_hold_their_weights(llm, LLM(model_dir, max_total_token_num=256, device="cpu"))
    agreed = check_follows_hf(llm, hf_model, cases)
    # FP8's noise flips greedy choices on a few percent of steps of these flat random logits (with --quant_lm_head
    # ~5 % more, as much as FP8 scales on the wrong rows do): those are caught above, this is a floor.
    assert sum(agreed) >= NEW_TOKENS * len(cases) // 3, agreed


def check_layers_hold_their_weights(fp8: LLM, unquantized: LLM) -> None:
    """Every FP8 linear of the decoder, dequantized, is the unquantized engine's weight (which equals HF's: the
    families' HF-equality tests) within e4m3's rounding: half a step, 2^-4 of a normal value, 2^-10 of the row's
    scale for a subnormal. Scales on the wrong rows miss by the ratio of two rows' scales."""
    from language.quant.fp8 import dequantize
    from language.quant.linear import Fp8Linear

    weights = dict(unquantized.engine.runner.model.layers.named_modules())
    checked = 0
    for name, layer in fp8.engine.runner.model.layers.named_modules():
        if isinstance(layer, Fp8Linear):
            want = weights[name].weight.float()
            bound = torch.maximum(want.abs() * 2.0**-4, layer.scales * 2.0**-10) * (1 + 1e-6)
            assert ((dequantize(layer.weight, layer.scales) - want).abs() <= bound).all(), name
            checked += 1
    assert checked == 4 * len(fp8.engine.runner.model.layers)  # q/k/v, o, gate/up, down


def test_fused_fp8_quant_keeps_the_greedy_tokens(model_dir, cases, monkeypatch):
    """The norms and gated activations writing the FP8 linears' inputs quantized (the default) against each linear
    quantizing its own (--disable_fp8_fused_quant): the same greedy tokens (the same e4m3 values and scales; q/k/v's
    bias on InternVL's Qwen2). The fused engine's layers do hand their linears quantized rows in prompt steps and in
    a lone decode row at most ONE_PASS_COLUMNS wide (these tiny models' rows all are), and a wider lone row with its
    largest magnitude measured (the bound lowered to 16 columns here): Llama's layer at both norms, Gemma 3's (whose
    own norms stay unfused) at its GELU. Decode batches of 2-64 rows take the lone row's forms."""
    fused = LLM(model_dir, max_total_token_num=2048, device="cpu", quant_type="fp8w8a8", chunked_prefill_size=256)
    unfused = LLM(model_dir, max_total_token_num=2048, device="cpu", quant_type="fp8w8a8", chunked_prefill_size=256,
                  fp8_fused_quant=False)  # fmt: skip
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts, items = [p for p, _, _ in cases], [i for _, i, _ in cases]
    prompts, items = [*prompts, list(range(3, 3 + 2 * SKINNY_MAX_ROWS))], [*items, []]  # a prompt step of > 64 rows
    _assert_rows_handed(unfused, torch.Tensor, torch.Tensor)
    want = [g.token_ids for g in unfused.generate(prompts, params, mm_items=items)]
    assert fused.engine.runner.model.layers[1].mlp.down_proj.in_features <= ONE_PASS_COLUMNS
    for one_pass, one_row in ((ONE_PASS_COLUMNS, QuantizedRows), (16, MeasuredRows)):
        monkeypatch.setattr(linear_module, "ONE_PASS_COLUMNS", one_pass)
        _assert_rows_handed(fused, QuantizedRows, one_row)
        assert [g.token_ids for g in fused.generate(prompts, params, mm_items=items)] == want


def _assert_rows_handed(llm: LLM, prompt_rows: type, decode_rows: type) -> None:
    """The rows layer 1's norms and gated activation hand their linears: a prompt step's, and a decode batch's (of
    SKINNY_MAX_ROWS rows, and of one)."""
    layer = llm.engine.runner.model.layers[1]
    for rows, form in ((SKINNY_MAX_ROWS + 1, prompt_rows), (SKINNY_MAX_ROWS, decode_rows), (1, decode_rows)):
        x = torch.randn(rows, layer.mlp.gate_up_proj.in_features, dtype=layer.input_layernorm.weight.dtype)
        gate_up = torch.randn(rows, layer.mlp.gate_up_proj.out_features, dtype=x.dtype)
        assert type(layer.mlp.activation(gate_up)) is form
        if type(layer).attention_input is DecoderLayer.attention_input:
            assert type(layer.attention_input(x, x)[0]) is form
            assert type(layer.attention_input(x, None)[0]) is form


@pytest.mark.parametrize("family", ["internvl"], indirect=True)
def test_int8_kv_cache_follows_hf(model_dir, hf_model, cases):
    llm = LLM(model_dir, max_total_token_num=2048, device="cpu", llm_kv_type="int8kv", chunked_prefill_size=16)
    assert llm.engine.kv.k[0].dtype == torch.int8
    agreed = check_follows_hf(llm, hf_model, cases)
    assert sum(agreed) >= 0.75 * NEW_TOKENS * len(cases), agreed


def test_tied_head_gets_its_own_fp8_copy(tmp_path):
    """Gemma 3 as published ties its head to the token embeddings: under --quant_type fp8w8a8 the embedding stays
    in the model's dtype, as written, and with --quant_lm_head the head holds an e4m3 copy of it."""
    model_dir = build_gemma3(str(tmp_path / "gemma3"))
    llm = LLM(model_dir, max_total_token_num=256, device="cpu", quant_type="fp8w8a8", quant_lm_head=True)
    model = llm.engine.runner.model
    embedding = checkpoint_tensor(model_dir, "language_model.model.embed_tokens.weight")
    assert model.embed_tokens.weight.dtype == torch.float32 and torch.equal(model.embed_tokens.weight, embedding)
    check_fp8_head(model, embedding)
    out = llm.generate([[2, 10, 20, 30]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
