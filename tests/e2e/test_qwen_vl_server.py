"""Issue 5's Qwen-VL (v1) acceptance over HTTP: the real server (--enable_multimodal --trust_remote_code) on a tiny
random checkpoint in the published remote-code layout gives, for the multi-turn two-image ChatML prompt with empty
`<img></img>` tags and for a one-image prompt, the greedy tokens of the in-process engine fed the same prompt ids and
our vision tower's embeddings; paths inside the tags are refused without --image_dir; and the example client runs
unchanged against it."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from PIL import Image

import visual.models.qwen_vl  # noqa: F401  (registers the architecture)
from language.request import MultimodalItem
from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from mmserve.prep.multimodal.prompt import prompt_processor_class
from mmserve.prep.tokenizers import load_tokenizer
from mmserve.testing.checkpoints.qwen_vl import build_qwen_vl
from mmserve.testing.images import picture, png_b64
from mmserve.testing.server_proc import ServerProcess, serving
from visual.models.base import vision_model_class

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "qwen_vl_chat_multiturn.py")
NEW_TOKENS = 12
ARCH = "QWenLMHeadModel"


def _example_module():
    spec = importlib.util.spec_from_file_location("qwen_vl_chat_multiturn", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")  # lossless: the server decodes exactly these pixels
    return buf.getvalue()


CASES = [
    (_example_module().build_prompt(2), [picture(300, 170, 5), picture(90, 400, 6)]),  # multi-turn, two images
    ("<|im_start|>user\n<img></img>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n", [picture(120, 80, 7)]),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_qwen_vl(str(tmp_path_factory.mktemp("qwen_vl")))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num",
                        "4096", "--enable_multimodal", "--trust_remote_code")  # fmt: skip
    with serving(srv):
        yield srv


def post(server, prompt: str, images: list[Image.Image], **parameters) -> httpx.Response:
    body = {
        "inputs": prompt,
        "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "return_details": True, **parameters},
        "multimodal_params": {"images": [{"type": "base64", "data": base64.b64encode(png_bytes(im)).decode()}
                                         for im in images]},
    }  # fmt: skip
    return httpx.post(server.url + "/generate", json=body, timeout=180)


def engine_tokens(model_dir: str) -> list[tuple[int, list[int]]]:
    """(prompt length, greedy tokens) per case from the in-process engine, with our vision tower's embeddings."""
    tokenizer = load_tokenizer(model_dir)
    prompter = prompt_processor_class(ARCH).from_pretrained(model_dir, tokenizer)
    vision = vision_model_class(ARCH).from_pretrained(model_dir, torch.device("cpu"), torch.float32)
    prompts, items = [], []
    for text, images in CASES:
        mm = prompter.encode(text, [im.size for im in images])
        embeds = vision.encode([vision.preprocess(im) for im in images])  # [256, hidden] each
        prompts.append(mm.token_ids)
        items.append([MultimodalItem(offset=o, embeds=e) for o, e in zip(mm.offsets, embeds, strict=True)])
    llm = LLM(model_dir, max_total_token_num=4096, device="cpu")
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), mm_items=items)
    return [(len(p), out.token_ids) for p, out in zip(prompts, outs, strict=True)]


def test_generate_equals_in_process_engine(server, model_dir):
    with ThreadPoolExecutor(len(CASES)) as pool:
        responses = list(pool.map(lambda case: post(server, *case), CASES))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    ours = [(r.json()["prompt_tokens"], [t["id"] for t in r.json()["tokens"]]) for r in responses]
    assert ours == engine_tokens(model_dir)

    # ChatML stop sequences are accepted; whatever stops early is a prefix of the same greedy answer.
    r = post(server, *CASES[0], ignore_eos=False, stop_sequences=["<|im_end|>", "<|im_start|>"])
    assert r.status_code == 200, r.text
    stopped = [t["id"] for t in r.json()["tokens"]]
    assert stopped and stopped == ours[0][1][: len(stopped)]


def test_paths_inside_img_tags_are_refused_without_image_dir(server):
    r = post(server, "<|im_start|>user\n<img>/etc/passwd</img>\nWhat is this?<|im_end|>\n", [])
    assert r.status_code == 400 and r.json()["field"] == "multimodal_params.images", r.text
    assert "passwd" not in json.dumps(r.json().get("generated_text", ""))
    r = post(server, CASES[1][0], [])  # an empty tag with no image sent
    assert r.status_code == 400 and r.json()["field"] == "multimodal_params.images", r.text


def test_example_client_runs_against_the_server(server, tmp_path):
    paths = []
    for i, image in enumerate(CASES[0][1]):
        paths.append(str(tmp_path / f"city{i}.png"))
        image.save(paths[-1])
    port = server.url.rsplit(":", 1)[1]
    run = subprocess.run([sys.executable, EXAMPLE, "--port", port, "--images", *paths, "--max_new_tokens", "4"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert isinstance(answer["generated_text"][0], str) and 1 <= answer["count_output_tokens"] <= 4


# What Qwen-VL-Chat's own `make_context` (qwen_generation_utils.py) builds for this conversation, the images written
# by its `from_list_format` ("Picture N: <img>...</img>\n"), here with empty tags that take the sent images in order.
QWEN_CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nPicture 1: <img></img>\nPicture 2: <img></img>\n"
    "Which two cities are shown in these pictures? Compare them.<|im_end|>\n"
    "<|im_start|>assistant\nThe pictures show Chongqing and Beijing.<|im_end|>\n"
    "<|im_start|>user\nWhere are these two cities?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_openai_chat_uses_the_builtin_template_and_the_folder_name(server, model_dir):
    """The tiktoken tokenizer carries no template and no name_or_path: /v1/models names the model folder, and a chat
    is rendered by the family's built-in ChatML template, as Qwen-VL-Chat's make_context renders it."""
    folder = os.path.basename(model_dir)
    models = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [folder]

    images = CASES[0][1]
    urls = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_b64(im)}} for im in images]
    messages = [
        {"role": "user", "content": [*urls, {"type": "text", "text": "Which two cities are shown in these pictures? "
                                                                      "Compare them."}]},
        {"role": "assistant", "content": "The pictures show Chongqing and Beijing."},
        {"role": "user", "content": "Where are these two cities?"},
    ]  # fmt: skip
    body = {"model": folder, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    reply = r.json()

    expected = post(server, QWEN_CHAT_PROMPT, images)
    assert expected.status_code == 200, expected.text
    assert reply["usage"]["prompt_tokens"] == expected.json()["prompt_tokens"]
    assert reply["choices"][0]["message"]["content"] == expected.json()["generated_text"][0]
