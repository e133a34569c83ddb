"""Issue 4's acceptance over HTTP for LLaVA-1.5, in both published layouts: greedy ids from `/generate` equal HF
transformers' LlavaForConditionalGeneration on the same weights, a shared new image is encoded once, and more
distinct images than the embedding cache holds all get through without leaking KV slots or cache entries."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

from mmserve.testing.checkpoints.llava import SYSTEM_PROMPT, build_llava_hf, build_llava_original
from mmserve.testing.server_proc import ServerProcess, serving
from tests.models.test_llava import IMAGES, hf_llava_from_original, noise_image, pad_processor

NEW_TOKENS = 16
CACHE_CAPACITY = 16
ONE_IMAGE = f"{SYSTEM_PROMPT} USER: <image>\nWhat is shown in this picture? ASSISTANT:"
TWO_IMAGES = f"{SYSTEM_PROMPT} USER: <image>\n<image>\nCompare the two pictures. ASSISTANT:"
TEXT_ONLY = f"{SYSTEM_PROMPT} USER: What is AI? ASSISTANT:"
ORIGINAL_PLACEHOLDER_ID = 0  # <unk> of the tiny tokenizer: the id the original layout's image positions carry


def image_b64(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def build_checkpoint(layout: str, root) -> str:
    if layout == "llava_hf":
        return build_llava_hf(str(root / "llava-hf"))  # published dialect: old tensor names, flat preprocessor
    return build_llava_original(str(root / "llava-v1.5"))  # CLIP tower in llava-v1.5-clip, named by config.json


@pytest.fixture(scope="module", params=["llava_hf", "original"])
def server(request, tmp_path_factory):
    """(server, model_dir, layout); the original layout also gets its CLIP folder through --vision_tower_dir."""
    layout = request.param
    model_dir = build_checkpoint(layout, tmp_path_factory.mktemp(layout))
    tower = ["--vision_tower_dir", model_dir + "-clip"] if layout == "original" else []
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num",
                        "2048", "--enable_multimodal", "--cache_capacity", str(CACHE_CAPACITY), *tower)  # fmt: skip
    with serving(srv):
        yield srv, model_dir, layout


def generate(srv: ServerProcess, prompt: str, images: list[Image.Image], max_new_tokens: int) -> dict:
    body = {"inputs": prompt,
            "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "return_details": True},
            "multimodal_params": {"images": [{"type": "base64", "data": image_b64(im)} for im in images]}}  # fmt: skip
    r = httpx.post(srv.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def generate_concurrently(srv: ServerProcess, jobs: list[tuple[str, list[Image.Image]]], max_new_tokens: int):
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: generate(srv, *job, max_new_tokens), jobs))


def ids(answer: dict) -> list[int]:
    return [t["id"] for t in answer["tokens"]]


# ------------------------------------------------------------------------------------------- HF references


def hf_greedy(model, input_ids: list[int], pixel_values: torch.Tensor | None) -> list[int]:
    """Greedy with ignore_eos semantics: EOS may be chosen and decoding goes on (min_new_tokens would instead mask
    EOS out of the argmax, which is not what the server's ignore_eos does)."""
    ids_ = torch.tensor([input_ids])
    images = {"pixel_values": pixel_values} if pixel_values is not None else {}
    with torch.no_grad():
        out = model.generate(input_ids=ids_, attention_mask=torch.ones_like(ids_), **images,
                             max_new_tokens=NEW_TOKENS, eos_token_id=[], do_sample=False)  # fmt: skip
    return out[0, len(input_ids) :].tolist()


def original_prompt_ids(model_dir: str, prompt: str, num_tokens_per_image: int) -> list[int]:
    """LLaVA's `tokenizer_image_token`: the text split at <image>, each chunk tokenized (BOS on the first only),
    the image positions in between."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chunks = [tokenizer(chunk).input_ids for chunk in prompt.split("<image>")]
    out = list(chunks[0])
    for chunk in chunks[1:]:
        out += [ORIGINAL_PLACEHOLDER_ID] * num_tokens_per_image + chunk[1:]
    return out


def hf_expected(model_dir: str, layout: str, jobs: list[tuple[str, list[Image.Image]]]):
    """(prompt ids, greedy new ids) of each job from HF transformers on the same weights."""
    if layout == "llava_hf":
        model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        processor = AutoProcessor.from_pretrained(model_dir)
        inputs = [processor(images=images or None, text=text, return_tensors="pt") for text, images in jobs]
        prompts = [x["input_ids"][0].tolist() for x in inputs]
        pixels = [x.get("pixel_values") for x in inputs]
    else:
        model = hf_llava_from_original(model_dir, image_token_index=ORIGINAL_PLACEHOLDER_ID)
        pad = pad_processor(model_dir)
        prompts = [original_prompt_ids(model_dir, text, 16) for text, _ in jobs]  # tiny tower: 4x4 patches
        pixels = [pad(images=images, return_tensors="pt")["pixel_values"] if images else None for _, images in jobs]
    return [(p, hf_greedy(model, p, px)) for p, px in zip(prompts, pixels, strict=True)]


# ----------------------------------------------------------------------------------------------------- tests


def test_greedy_ids_equal_hf_with_one_and_two_images_beside_text(server):
    srv, model_dir, layout = server
    jobs = [(ONE_IMAGE, IMAGES[:1]), (TWO_IMAGES, IMAGES), (TEXT_ONLY, [])]  # 80x50 and 40x70 images
    answers = generate_concurrently(srv, jobs, NEW_TOKENS)
    for (text, _), answer, (prompt_ids, expected) in zip(jobs, answers, hf_expected(model_dir, layout, jobs),
                                                         strict=True):  # fmt: skip
        assert answer["prompt_tokens"] == len(prompt_ids), text
        assert ids(answer) == expected, text
    assert srv.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0) == 0


def test_six_concurrent_requests_share_one_encoding(server):
    srv, _, _ = server
    before = srv.metrics()
    image = noise_image(60, 44, seed=123)  # not sent before
    answers = generate_concurrently(srv, [(ONE_IMAGE, [image])] * 6, 4)
    after = srv.metrics()
    assert after["mmserve_images_encoded_total"] - before["mmserve_images_encoded_total"] == 1
    assert after["mmserve_embed_cache_hits_total"] > before["mmserve_embed_cache_hits_total"]
    # Equal answers: text and ids. Logprobs only closely: each request may sit in a differently shaped batch.
    assert all(a["generated_text"] == answers[0]["generated_text"] and ids(a) == ids(answers[0]) for a in answers)
    for a in answers:
        logprobs = [t["logprob"] for t in a["tokens"]]
        assert logprobs == pytest.approx([t["logprob"] for t in answers[0]["tokens"]], abs=1e-4)


@pytest.mark.parametrize("server", ["llava_hf"], indirect=True)
def test_forty_distinct_images_through_a_cache_of_sixteen(server):
    srv, _, _ = server
    before = srv.metrics()["mmserve_images_encoded_total"]
    images = [noise_image(32, 32, seed=1000 + i) for i in range(40)]
    for start in range(0, len(images), 8):
        generate_concurrently(srv, [(ONE_IMAGE, [im]) for im in images[start : start + 8]], 1)  # each asserts 200
    assert srv.metrics()["mmserve_images_encoded_total"] - before == 40
    assert srv.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0) == 0
    assert srv.metrics()["mmserve_embed_cache_items"] <= CACHE_CAPACITY
