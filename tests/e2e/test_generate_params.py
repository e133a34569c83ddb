"""LightLLM's /generate parameters through the real server (tiny random Llama, byte-level BPE with <s>=1, </s>=2):
n and best_of fan out and join, each parameter shows its effect over HTTP, unsupported ones get a 400 naming them,
and nothing is left running or held once requests end or their clients leave."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image
from transformers import AutoTokenizer

from mmserve.testing.server_proc import ServerProcess, serving

PROMPT = "A chat between a curious human and an artificial intelligence assistant. USER: Describe Beijing."
BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def server(e2e_model_dir, tmp_path_factory):
    srv = ServerProcess(
        e2e_model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--max_total_token_num", "2048"
    )
    try:
        srv.wait_healthy()
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, srv.log()
        assert srv.leftover_children() == [], "child processes outlived the server"


@pytest.fixture(scope="module")
def tokenizer(e2e_model_dir):
    return AutoTokenizer.from_pretrained(e2e_model_dir)


def post(server, path: str = "/generate", inputs: str = PROMPT, **parameters) -> httpx.Response:
    return httpx.post(server.url + path, json={"inputs": inputs, "parameters": parameters}, timeout=120)


def generate(server, **parameters) -> dict:
    r = post(server, **parameters)
    assert r.status_code == 200, r.text
    return r.json()


def settled(server) -> None:
    server.wait_metric("mmserve_requests_running", lambda v: v == 0)
    server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)


def test_n_returns_n_texts(server):
    one = generate(server, max_new_tokens=12, ignore_eos=True)
    assert len(one["generated_text"]) == 1 and one["count_output_tokens"] == 12  # n = 1: as before
    greedy = generate(server, n=2, max_new_tokens=12, ignore_eos=True, return_details=True)
    assert greedy["generated_text"] == one["generated_text"] * 2  # greedy sequences are all the same
    assert greedy["count_output_tokens"] == [12, 12] and greedy["finish_reason"] == ["length", "length"]
    assert len(greedy["tokens"]) == 2 and all(len(t) == 12 for t in greedy["tokens"])
    sampled = generate(server, n=3, do_sample=True, temperature=1.5, seed=7, max_new_tokens=16, ignore_eos=True)
    texts = sampled["generated_text"]
    assert len(texts) == 3 and len(set(texts)) > 1  # distinct sub-seeds
    again = generate(server, n=3, do_sample=True, temperature=1.5, seed=7, max_new_tokens=16, ignore_eos=True)
    assert again["generated_text"] == texts  # and reproducible
    settled(server)


def test_best_of_keeps_the_most_likely(server):
    params = {"do_sample": True, "temperature": 1.5, "seed": 11, "max_new_tokens": 10, "ignore_eos": True}
    all_three = generate(server, n=3, return_details=True, **params)
    best = generate(server, n=1, best_of=3, return_details=True, **params)
    scores = [sum(t["logprob"] for t in tokens) for tokens in all_three["tokens"]]
    winner = max(range(3), key=lambda i: scores[i])
    assert best["generated_text"] == [all_three["generated_text"][winner]]
    assert best["count_output_tokens"] == 10  # one sequence: scalar fields, as LightLLM
    settled(server)


def test_allowed_token_ids_logit_bias_min_new_tokens(server, tokenizer):
    allowed = [300, 301, 302, 303]
    out = generate(
        server, allowed_token_ids=allowed, do_sample=True, max_new_tokens=20, ignore_eos=True, return_details=True
    )
    assert {t["id"] for t in out["tokens"]} <= set(allowed) and len(out["tokens"]) == 20
    forced = generate(server, logit_bias={"305": 100}, max_new_tokens=6, ignore_eos=True, return_details=True)
    assert [t["id"] for t in forced["tokens"]] == [305] * 6
    early = generate(server, logit_bias={str(EOS): 100}, max_new_tokens=20, return_details=True)
    assert [t["id"] for t in early["tokens"]] == [EOS] and early["finish_reason"] == "stop"
    held = generate(server, logit_bias={str(EOS): 100}, min_new_tokens=7, max_new_tokens=20, return_details=True)
    ids = [t["id"] for t in held["tokens"]]
    assert len(ids) == 8 and EOS not in ids[:7] and ids[-1] == EOS and held["finish_reason"] == "stop"


def test_min_p_of_one_keeps_only_the_most_likely(server):
    """vLLM's min_p, on /generate and /v1/completions: at 1 only ids as likely as the most likely stay, so sampling
    at temperature 1 answers the greedy tokens."""
    greedy = generate(server, max_new_tokens=6, ignore_eos=True)["generated_text"]
    assert generate(server, do_sample=True, min_p=1.0, max_new_tokens=6, ignore_eos=True)["generated_text"] == greedy
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 1.0, "min_p": 1.0, "seed": 3}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy[0], r.text


def test_include_stop_str_in_output_keeps_the_stop_string(server):
    """vLLM's include_stop_str_in_output, on /generate and /v1/completions: the text ends after the stop string, not
    before it; the completion's choice names it as its stop_reason, streamed or not."""
    text = generate(server, max_new_tokens=12, ignore_eos=True)["generated_text"][0]
    stop = text[5:8]
    end = text.find(stop)
    cut = generate(server, max_new_tokens=12, ignore_eos=True, stop_sequences=[stop])["generated_text"][0]
    kept = generate(server, max_new_tokens=12, ignore_eos=True, stop_sequences=[stop], include_stop_str_in_output=True)
    assert (cut, kept["generated_text"][0]) == (text[:end], text[: end + len(stop)])
    body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0, "stop": [stop],
            "include_stop_str_in_output": True}  # fmt: skip
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text[: end + len(stop)], r.text
    assert r.json()["choices"][0]["stop_reason"] == stop  # vLLM's: what stopped it
    r = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "stop" and events[-1]["choices"][0]["stop_reason"] == stop
    plain = httpx.post(server.url + "/v1/completions", json={**body, "stop": None}, timeout=60).json()
    assert plain["choices"][0]["finish_reason"] == "length" and plain["choices"][0]["stop_reason"] is None


def test_text_options(server, tokenizer):
    forced_eos = {"logit_bias": {str(EOS): 100}, "min_new_tokens": 3, "max_new_tokens": 10}
    plain = generate(server, **forced_eos)
    printed = generate(server, print_eos_token=True, **forced_eos)
    assert not plain["generated_text"][0].endswith("</s>")
    assert printed["generated_text"][0] == plain["generated_text"][0] + "</s>"
    bos = {"logit_bias": {str(BOS): 100}, "max_new_tokens": 3, "ignore_eos": True}
    assert generate(server, **bos)["generated_text"] == [""]  # special tokens skipped, as before
    assert generate(server, skip_special_tokens=False, **bos)["generated_text"] == ["<s><s><s>"]
    with_bos = generate(server, max_new_tokens=2)["prompt_tokens"]
    assert with_bos == len(tokenizer(PROMPT).input_ids)
    assert generate(server, add_special_tokens=False, max_new_tokens=2)["prompt_tokens"] == with_bos - 1
    accepted = generate(
        server,
        max_new_tokens=4,
        add_spaces_between_special_tokens=False,
        image_max_patch_num=-1,
        group_request_id=3,
        input_penalty=True,
        presence_penalty=0.5,
        exponential_decay_length_penalty=[2, 1.1],
        prompt_logprobs=None,
    )
    assert len(accepted["generated_text"]) == 1


@pytest.mark.parametrize(
    "path,parameters,field",
    [
        ("/generate", {"guided_json": {"type": "foo"}}, "parameters.guided_json"),
        ("/generate", {"regular_constraint": "(a+"}, "parameters.regular_constraint"),
        ("/generate", {"guided_grammar": "root ::= x"}, "parameters.guided_grammar"),
        ("/generate", {"prompt_logprobs": 21}, "parameters.prompt_logprobs"),
        ("/generate", {"skip_special_token": True}, "parameters.skip_special_token"),
        ("/generate", {"logit_bias": {"100000": 1}}, "parameters.logit_bias"),
        ("/generate", {"allowed_token_ids": [100000]}, "parameters.allowed_token_ids"),
        ("/generate", {"n": 2, "logit_bias": {"100000": 1}}, "parameters.logit_bias"),
        ("/generate", {"n": 3, "best_of": 2}, "parameters.best_of"),
        ("/generate_stream", {"n": 2}, "parameters.n"),
        ("/generate_stream", {"best_of": 2}, "parameters.best_of"),
    ],
)
def test_refusals_name_the_parameter(server, path, parameters, field):
    r = post(server, path, **parameters)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field
    settled(server)


def test_client_leaving_aborts_every_sequence(server):
    params = {"n": 3, "max_new_tokens": 600, "ignore_eos": True}

    async def start_then_leave():
        async with httpx.AsyncClient(timeout=120) as client:
            task = asyncio.create_task(
                client.post(server.url + "/generate", json={"inputs": PROMPT, "parameters": params})
            )
            await asyncio.to_thread(server.wait_metric, "mmserve_requests_running", lambda v: v == 3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    before = server.metrics()["mmserve_generated_tokens_total"]
    asyncio.run(start_then_leave())
    settled(server)
    assert server.metrics()["mmserve_generated_tokens_total"] - before < 3 * 600
    assert len(generate(server, n=2, max_new_tokens=3)["generated_text"]) == 2  # and it keeps serving


# ------------------------------------------------------------------------- with images (tiny Qwen2-VL, multimodal)


@pytest.fixture(scope="module")
def mm_server(tmp_path_factory):
    from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl

    model_dir = build_qwen2_vl(str(tmp_path_factory.mktemp("qwen2_vl")))
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    srv = ServerProcess(model_dir, log, "--max_total_token_num", "4096", "--enable_multimodal")
    with serving(srv):
        yield srv


def test_n_with_an_image_shares_it_and_lets_go(mm_server):
    rng = np.random.default_rng(3)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8)).save(buf, format="PNG")
    prompt = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe it.<|im_end|>\n<|im_start|>assistant\n"
    )
    body = {
        "inputs": prompt,
        "multimodal_params": {"images": [{"type": "base64", "data": base64.b64encode(buf.getvalue()).decode()}]},
    }

    def ask(**parameters) -> dict:
        r = httpx.post(mm_server.url + "/generate", json={**body, "parameters": parameters}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    one = ask(max_new_tokens=8, ignore_eos=True)
    two = ask(n=2, max_new_tokens=8, ignore_eos=True)
    assert two["generated_text"] == one["generated_text"] * 2 and two["prompt_tokens"] == one["prompt_tokens"]
    sampled = ask(n=3, do_sample=True, seed=1, max_new_tokens=8, ignore_eos=True, add_special_tokens=False)
    assert len(sampled["generated_text"]) == 3 and sampled["prompt_tokens"] == one["prompt_tokens"]  # no BOS here
    assert mm_server.metrics()["mmserve_images_encoded_total"] == 1  # one image, encoded once for all sequences
    settled(mm_server)


def test_an_image_in_a_chat_to_a_text_only_server_names_the_flag(server):
    """The same refusal as /generate's for images sent to a server started without --enable_multimodal (this
    checkpoint has no chat template either: the image is what the client must hear about)."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[1].image_url", error
    assert "started without --enable_multimodal" in error["message"], error
    settled(server)


def test_refusal_bodies_are_exact(server, tokenizer):
    """The engine's refusal (an id out of the vocabulary, checked where the model's size is known) and the length
    refusal (checked before anything is queued) answer with the same bodies whichever process finds them."""
    r = post(server, logit_bias={"100000": 1})
    assert r.status_code == 400, r.text
    vocab = r.json()["error"].rsplit("size ", 1)[-1].rstrip(")")
    assert r.json() == {
        "error": f"parameters.logit_bias: token ids [100000] are out of the vocabulary (size {vocab})",
        "field": "parameters.logit_bias",
    }
    prompt_len = len(tokenizer(PROMPT).input_ids)
    r = post(server, max_new_tokens=2048)
    assert r.status_code == 400, r.text
    assert r.json() == {
        "error": f"parameters.max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens (2048) exceeds this "
        "server's limit of 2048 tokens per request",
        "field": "parameters.max_new_tokens",
    }
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2048}, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["message"] == (
        f"max_tokens: prompt ({prompt_len} tokens) + max_tokens (2048) exceeds this server's limit of 2048 tokens per "
        "request"
    )
    settled(server)
