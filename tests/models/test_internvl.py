"""InternVL against HF transformers on tiny random checkpoints, in the -hf layout (`InternVLForConditionalGeneration`,
both tensor namings) and the remote-code one (`InternVLChatModel`, against HF on the same weights in the -hf layout):
the tiles, their features and the prompt expansion equal InternVLProcessor's and InternVLModel's, and greedy tokens
through our engine equal HF generate for one image, two images of different tile counts and text alone, whole and in
small prefill chunks."""

import json
import os
import pickle

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoProcessor, InternVLForConditionalGeneration

from mmserve.testing.checkpoints.internvl import build_internvl_hf
from mmserve.testing.checkpoints.internvl_chat import build_internvl_chat
from tests.models.test_llava import noise_image
from visual.models.internvl import MIN_TRANSFORMERS, InternVLVisionModel

pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < Version(MIN_TRANSFORMERS),
    reason=f"InternVL needs transformers >= {MIN_TRANSFORMERS}",
)

CPU = torch.device("cpu")
IMAGES = [noise_image(80, 50, 0), noise_image(90, 300, 1)]  # 6 tiles + thumbnail, 3 tiles + thumbnail (112 px)
NEW_TOKENS = 12
PROMPTS = [
    ("<|im_start|>user\n<IMG_CONTEXT>\nWhat is shown in this picture?<|im_end|>\n<|im_start|>assistant\n", [0]),
    ("<|im_start|>user\n<IMG_CONTEXT>\n<IMG_CONTEXT>\nCompare the two pictures.<|im_end|>\n<|im_start|>assistant\n",
     [0, 1]),
    ("<|im_start|>user\nWhat is AI?<|im_end|>\n<|im_start|>assistant\n", []),
]  # fmt: skip


@pytest.fixture(scope="module", params=["new_names", "legacy_names", "remote_code"])
def model_dir(request, tmp_path_factory):
    out = str(tmp_path_factory.mktemp(request.param) / "internvl")
    if request.param == "remote_code":
        return build_internvl_chat(out)
    return build_internvl_hf(out, legacy_names=request.param == "legacy_names")


def hf_dir(model_dir: str) -> str:
    """Where HF's reference reads the weights: the folder itself, or the remote-code layout's -hf twin."""
    return model_dir + "-hf" if os.path.exists(model_dir + "-hf") else model_dir


def arch(model_dir: str) -> str:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["architectures"][0]


def our_text(model_dir: str, hf_text: str) -> str:
    """The prompt we get for one HF's processor takes: the remote-code layout writes `<image>`."""
    return hf_text.replace("<IMG_CONTEXT>", "<image>") if arch(model_dir) == "InternVLChatModel" else hf_text


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return InternVLForConditionalGeneration.from_pretrained(hf_dir(model_dir), dtype=torch.float32).eval()


def test_tiles_and_features_equal_hf(model_dir, hf_model):
    ours = InternVLVisionModel.from_pretrained(model_dir, CPU, torch.float32)
    processor = AutoProcessor.from_pretrained(hf_dir(model_dir))
    preprocess = pickle.loads(pickle.dumps(ours.preprocessor()))  # as the visual process's worker pool runs it
    inputs = [preprocess(im) for im in IMAGES]
    assert [im.pixel_values.shape[0] for im in inputs] == [7, 4]  # different tile counts
    assert [im.num_tokens for im in inputs] == [7 * 16, 4 * 16]
    assert [ours.num_tokens(*im.size) for im in IMAGES] == [7 * 16, 4 * 16]
    hf_pixels = processor(text="<IMG_CONTEXT><IMG_CONTEXT>", images=IMAGES, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(torch.cat([im.pixel_values for im in inputs]), hf_pixels, rtol=0, atol=0)
    with torch.no_grad():
        expected = hf_model.model.get_image_features(hf_pixels).pooler_output  # [tiles, 16, hidden]
    got = ours.encode(inputs)
    assert [g.shape for g in got] == [(7 * 16, 64), (4 * 16, 64)]
    torch.testing.assert_close(torch.cat(got), expected.reshape(-1, 64), rtol=1e-5, atol=1e-5)


def our_generation(model_dir: str, prefix: str, chunked_prefill_size: int = 4096):
    """Prompt ids and greedy tokens through our pieces: prompt processor, vision model -> shared-memory cache ->
    the language engine, all prompts in one batch."""
    from transformers import AutoTokenizer

    from cache.shm_store import read_embedding, write_embedding
    from language.request import MultimodalItem
    from language.sampling_params import SamplingParams
    from mmserve.llm import LLM
    from mmserve.prep.multimodal.prompt import prompt_processor_class

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = prompt_processor_class(arch(model_dir)).from_pretrained(model_dir, tokenizer)
    vision = InternVLVisionModel.from_pretrained(model_dir, CPU, torch.float32)
    for i, emb in enumerate(vision.encode([vision.preprocess(im) for im in IMAGES])):
        write_embedding(prefix, f"img{i}", emb)
    prompts, items = [], []
    for text, image_ids in PROMPTS:
        mm = processor.encode(our_text(model_dir, text), [IMAGES[i].size for i in image_ids])
        prompts.append(mm.token_ids)
        items.append([MultimodalItem(off, read_embedding(prefix, f"img{i}"), f"img{i}")
                      for off, i in zip(mm.offsets, image_ids, strict=True)])  # fmt: skip
    llm = LLM(model_dir, device="cpu", data_type="float32", max_total_token_num=2048,
              chunked_prefill_size=chunked_prefill_size)  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), mm_items=items)
    return prompts, [o.token_ids for o in outs]


def hf_greedy(model, inputs) -> list[int]:
    """Greedy with ignore_eos semantics: EOS may be chosen and decoding goes on."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=0, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture
def shm_prefix():
    from cache.shm_store import new_prefix, unlink_all

    prefix = new_prefix()
    yield prefix
    unlink_all(prefix)


def test_greedy_tokens_equal_hf(model_dir, hf_model, shm_prefix):
    prompts, ours = our_generation(model_dir, shm_prefix)
    processor = AutoProcessor.from_pretrained(hf_dir(model_dir))
    for (text, image_ids), prompt_ids, got in zip(PROMPTS, prompts, ours, strict=True):
        inputs = processor(text=text, images=[IMAGES[i] for i in image_ids] or None, return_tensors="pt")
        assert prompt_ids == inputs["input_ids"][0].tolist(), text  # InternVLProcessor's expansion
        assert got == hf_greedy(hf_model, inputs), text


@pytest.mark.parametrize("model_dir", ["new_names", "remote_code"], indirect=True)
def test_a_request_tile_cap_is_hf_max_patches(model_dir):
    """LightLLM's image_max_patch_num reaches the preprocessor and the prompt as HF's `max_patches`."""
    from transformers import AutoTokenizer

    from mmserve.prep.multimodal.prompt import prompt_processor_class

    ours = InternVLVisionModel.from_pretrained(model_dir, CPU, torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = prompt_processor_class(arch(model_dir)).from_pretrained(model_dir, tokenizer)
    processor = AutoProcessor.from_pretrained(hf_dir(model_dir))
    text = PROMPTS[0][0]
    for cap in (0, 1, 2, 5):
        hf = processor(text=text, images=IMAGES[:1], max_patches=cap, return_tensors="pt")
        tiles = ours.preprocess(IMAGES[0], max_patches=cap)
        torch.testing.assert_close(tiles.pixel_values, hf["pixel_values"], rtol=0, atol=0)
        encoded = prompts.encode_tiled(our_text(model_dir, text), [IMAGES[0].size], cap)
        assert encoded.token_ids == hf["input_ids"][0].tolist()
    assert ours.preprocess(IMAGES[0], max_patches=2).num_tokens == 3 * 16  # two tiles and the thumbnail


@pytest.mark.parametrize("model_dir", ["new_names"], indirect=True)
def test_chunked_prefill_equals_unsplit(model_dir, shm_prefix):
    """5-token chunks: each image's 64 or 112 positions span many chunks, batched with the others' decode rows."""
    _, whole = our_generation(model_dir, shm_prefix)
    _, chunked = our_generation(model_dir, shm_prefix, chunked_prefill_size=5)
    assert chunked == whole
