"""LLaVA-1.5 against HF transformers on tiny random checkpoints in both published layouts."""

import glob
import json
import os

import pytest
import torch
from PIL import Image
from transformers import (
    AutoProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaImageProcessor,
)

from mmserve.testing.checkpoints.llava import build_llava_hf, build_llava_original, clip_preprocessor_config
from visual.models.llava import LlavaVisionModel
from visual.models.weights import load_prefixed_tensors

CPU = torch.device("cpu")


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


IMAGES = [noise_image(80, 50, 0), noise_image(40, 70, 1)]  # non-square both ways


@pytest.fixture(scope="module", params=["legacy_names", "new_names", "nested_processor_config"])
def llava_hf_dir(request, tmp_path_factory):
    out = str(tmp_path_factory.mktemp(request.param))
    return build_llava_hf(
        out,
        new_names=request.param == "new_names",
        nested_processor_config=request.param == "nested_processor_config",
    )


@pytest.fixture(scope="module")
def original_dir(tmp_path_factory):
    return build_llava_original(str(tmp_path_factory.mktemp("original") / "llava-v1.5"))


def hf_llava_from_original(model_dir: str, image_token_index: int) -> LlavaForConditionalGeneration:
    """An HF Llava holding the original layout's weights (LLM + projector from the folder, tower from the CLIP
    folder), to compare the original layout against."""
    raw = json.load(open(os.path.join(model_dir, "config.json")))
    text = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type", "_name_or_path")})
    config = LlavaConfig(
        vision_config=CLIPVisionConfig.from_pretrained(raw["mm_vision_tower"]).to_dict(),
        text_config=text.to_dict(),
        image_token_index=image_token_index,
        projector_hidden_act="gelu",
        vision_feature_layer=raw["mm_vision_select_layer"],
        vision_feature_select_strategy="default",
    )
    model = LlavaForConditionalGeneration(config).eval()
    renames = {"model.mm_projector.0.": "model.multi_modal_projector.linear_1.",
               "model.mm_projector.2.": "model.multi_modal_projector.linear_2.",
               "model.": "model.language_model.", "lm_head.": "lm_head."}  # fmt: skip
    state = {}
    for name, tensor in load_prefixed_tensors(model_dir, ("",)).items():
        old = next(p for p in renames if name.startswith(p))
        state[renames[old] + name[len(old) :]] = tensor
    clip = load_prefixed_tensors(raw["mm_vision_tower"], ("vision_model.",))
    tower = {"model.vision_tower." + k: v for k, v in clip.items()}
    nested = any(k.startswith("model.vision_tower.vision_model.") for k in model.state_dict())
    if nested:
        tower = {k.replace("model.vision_tower.", "model.vision_tower.vision_model."): v for k, v in tower.items()}
    model.load_state_dict({**state, **tower}, strict=True)
    return model


def pad_processor(model_dir: str) -> LlavaImageProcessor:
    """HF's own pad-to-square preprocessing (mean-colour background), configured like the CLIP folder's."""
    raw = json.load(open(os.path.join(model_dir, "config.json")))
    cfg = json.load(open(os.path.join(raw["mm_vision_tower"], "preprocessor_config.json")))
    cfg.pop("image_processor_type")
    return LlavaImageProcessor(**cfg, do_pad=True)


def our_features(model_dir: str) -> list[torch.Tensor]:
    model = LlavaVisionModel.from_pretrained(model_dir, CPU, torch.float32)
    return model.encode([model.preprocess(im) for im in IMAGES])


def test_image_features_equal_hf_llava_hf_layout(llava_hf_dir):
    hf = LlavaForConditionalGeneration.from_pretrained(llava_hf_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(llava_hf_dir)
    pixels = processor.image_processor(images=IMAGES, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = hf.get_image_features(pixels, vision_feature_layer=-2, vision_feature_select_strategy="default")
    expected = expected.pooler_output if hasattr(expected, "pooler_output") else expected
    ours = our_features(llava_hf_dir)
    assert len(ours) == 2 and ours[0].shape == (16, 64)
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want.reshape(got.shape), rtol=1e-5, atol=1e-5)


def test_image_features_equal_hf_original_layout(original_dir):
    hf = hf_llava_from_original(original_dir, image_token_index=0)
    pixels = pad_processor(original_dir)(images=IMAGES, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = hf.get_image_features(pixels, vision_feature_layer=-2, vision_feature_select_strategy="default")
    expected = expected.pooler_output if hasattr(expected, "pooler_output") else expected
    ours = our_features(original_dir)
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want.reshape(got.shape), rtol=1e-5, atol=1e-5)


def test_original_layout_pads_to_square_first(original_dir):
    model = LlavaVisionModel.from_pretrained(original_dir, CPU, torch.float32)
    raw = json.load(open(os.path.join(original_dir, "config.json")))
    unpadded = clip_preprocessor_config(56)
    unpadded.pop("image_processor_type")
    plain = LlavaImageProcessor(**unpadded, do_pad=False)(images=IMAGES[:1], return_tensors="pt")["pixel_values"][0]
    ours = model.preprocess(IMAGES[0]).pixel_values
    assert not torch.allclose(ours, plain)  # padding changes what the tower sees
    assert raw["image_aspect_ratio"] == "pad"


def test_vision_tower_dir_override(original_dir, tmp_path):
    raw = json.load(open(os.path.join(original_dir, "config.json")))
    moved = tmp_path / "model"
    moved.mkdir()
    for path in glob.glob(os.path.join(original_dir, "*")):
        os.symlink(path, moved / os.path.basename(path))
    os.unlink(moved / "config.json")
    json.dump({**raw, "mm_vision_tower": "openai/clip-vit-large-patch14-336"}, open(moved / "config.json", "w"))
    with pytest.raises(ValueError, match="--vision_tower_dir"):
        LlavaVisionModel.from_pretrained(str(moved), CPU, torch.float32)
    model = LlavaVisionModel.from_pretrained(str(moved), CPU, torch.float32, vision_tower_dir=raw["mm_vision_tower"])
    assert model.num_tokens(123, 45) == 16


# ------------------------------------------------------------------------ the whole model: greedy tokens vs HF

PROMPTS = [
    ("USER: <image>\nWhat is shown in this picture? ASSISTANT:", [0]),
    ("USER: <image>\n<image>\nCompare the two pictures. ASSISTANT:", [0, 1]),
    ("USER: What is AI? ASSISTANT:", []),
]
NEW_TOKENS = 12


def our_generation(
    model_dir: str, architecture: str, prefix: str, chunked_prefill_size: int = 4096
) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids and greedy tokens through our pieces: prompt processor, vision model -> shared-memory cache ->
    router-side views -> the language engine, all prompts in one batch."""
    from transformers import AutoTokenizer

    from cache.shm_store import read_embedding, write_embedding
    from language.request import MultimodalItem
    from language.sampling_params import SamplingParams
    from mmserve.llm import LLM
    from mmserve.prep.multimodal.prompt import prompt_processor_class

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = prompt_processor_class(architecture).from_pretrained(model_dir, tokenizer)
    vision = LlavaVisionModel.from_pretrained(model_dir, CPU, torch.float32)
    for i, emb in enumerate(vision.encode([vision.preprocess(im) for im in IMAGES])):
        write_embedding(prefix, f"img{i}", emb)
    prompts, items = [], []
    for text, image_ids in PROMPTS:
        mm = processor.encode(text, [IMAGES[i].size for i in image_ids])
        prompts.append(mm.token_ids)
        items.append([MultimodalItem(off, read_embedding(prefix, f"img{i}"), f"img{i}")
                      for off, i in zip(mm.offsets, image_ids, strict=True)])  # fmt: skip
    llm = LLM(
        model_dir,
        device="cpu",
        data_type="float32",
        max_total_token_num=1024,
        chunked_prefill_size=chunked_prefill_size,
    )
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, mm_items=items)
    return prompts, [o.token_ids for o in outs]


def hf_greedy(model, input_ids: list[int], pixel_values: torch.Tensor | None) -> list[int]:
    ids = torch.tensor([input_ids])
    images = {"pixel_values": pixel_values} if pixel_values is not None else {}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **images,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)  # fmt: skip
    return out[0, len(input_ids) :].tolist()


@pytest.fixture
def shm_prefix():
    from cache.shm_store import new_prefix, unlink_all

    prefix = new_prefix()
    yield prefix
    unlink_all(prefix)


@pytest.fixture(scope="module")
def llava_hf_legacy_dir(tmp_path_factory):
    return build_llava_hf(str(tmp_path_factory.mktemp("gen_llava_hf")))


def test_greedy_tokens_equal_hf_llava_hf_layout(llava_hf_legacy_dir, shm_prefix):
    model_dir = llava_hf_legacy_dir
    prompts, ours = our_generation(model_dir, "LlavaForConditionalGeneration", shm_prefix)
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    for (text, image_ids), prompt_ids, got in zip(PROMPTS, prompts, ours, strict=True):
        images = [IMAGES[i] for i in image_ids] or None
        inputs = processor(images=images, text=text, return_tensors="pt")
        assert prompt_ids == inputs["input_ids"][0].tolist()  # same expansion as LlavaProcessor
        assert got == hf_greedy(hf, prompt_ids, inputs.get("pixel_values")), text


def test_greedy_tokens_equal_hf_original_layout(original_dir, shm_prefix):
    prompts, ours = our_generation(original_dir, "LlavaLlamaForCausalLM", shm_prefix)
    hf = hf_llava_from_original(original_dir, image_token_index=0)  # our placeholder id in the original layout
    pad = pad_processor(original_dir)
    for (text, image_ids), prompt_ids, got in zip(PROMPTS, prompts, ours, strict=True):
        pixels = pad(images=[IMAGES[i] for i in image_ids], return_tensors="pt")["pixel_values"] if image_ids else None
        assert prompt_ids.count(0) == 16 * len(image_ids)
        assert got == hf_greedy(hf, prompt_ids, pixels), text


def test_chunked_prefill_equals_unsplit(llava_hf_legacy_dir, shm_prefix):
    """Prompts split into 5-token chunks (each 16-token image spans four chunks, batched with decode rows of the
    other prompts) give the tokens of whole-prompt prefill."""
    arch = "LlavaForConditionalGeneration"
    prompts, whole = our_generation(llava_hf_legacy_dir, arch, shm_prefix)
    assert min(len(p) for p in prompts) > 5
    _, chunked = our_generation(llava_hf_legacy_dir, arch, shm_prefix, chunked_prefill_size=5)
    assert chunked == whole
