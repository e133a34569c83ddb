"""Issue 11's CPU acceptance: the real server at --tp 2 (2 ranks on gloo: the router process is rank 0, one worker
process rank 1) gives HF transformers' greedy tokens for the tiny Llama, LLaVA-1.5, Qwen2-VL, Gemma 3 and InternVL2.5
(InternLM2) checkpoints, images included (their rows reach rank 1 through the step's broadcast); killing a rank
mid-load fails the server (on the Llama's server, after its comparison: one start for both); a tp that does not divide
the heads is refused at once.
No server outlives its tests (the Llama's ends with the kill), so none idles beside the next one's start."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mmserve.testing.checkpoints.llava import build_llava_hf
from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
from mmserve.testing.server_proc import ServerProcess, free_port, serving
from tests.e2e import qwen_vl_cases
from tests.e2e import test_llava_server as llava
from tests.e2e.test_qwen2_vl_server import FAMILY as QWEN2_VL
from tests.e2e.test_server_failure import kill_child_mid_load
from tests.models.hf_reference import hf_greedy
from tests.models.test_llava import IMAGES

NEW_TOKENS = 12


def tp_args(kv_tokens: int = 4096) -> list[str]:
    return ["--tp", "2", "--nccl_port", str(free_port()), "--max_total_token_num", str(kv_tokens)]


@pytest.fixture(scope="module")
def llama_server(e2e_model_dir, tmp_path_factory):
    """One --tp 2 server for the HF comparison and then for killing a rank (the test right after it ends it)."""
    kv_tokens = 8192  # the kill test's two 4000-token requests
    srv = ServerProcess(e2e_model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), *tp_args(kv_tokens))
    srv.wait_healthy()
    yield srv
    if srv.proc.poll() is None:  # the kill test did not run (deselected) or did not get to kill
        srv.stop_cleanly()


def test_llama_tp2_equals_hf(llama_server, e2e_model_dir):
    hf = AutoModelForCausalLM.from_pretrained(e2e_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(e2e_model_dir)
    prompts = ["What is AI?", "Tell me a long story about a dragon " * 4, "The capital of France is " * 12]

    def generate(prompt: str) -> dict:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True,
                                                 "return_details": True}}  # fmt: skip
        r = httpx.post(llama_server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(len(prompts)) as pool:  # one batch in the engine
        answers = list(pool.map(generate, prompts))
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = tokenizer(prompt).input_ids
        assert answer["prompt_tokens"] == len(ids)
        assert [t["id"] for t in answer["tokens"]] == hf_greedy(hf, ids, NEW_TOKENS), prompt
    assert llama_server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0) == 0


def test_killing_a_rank_mid_load_fails_the_server(llama_server):
    """Issue 11: a tensor-parallel rank (mmserve-tp1) killed while rank 0 runs steps with it: in-flight requests
    fail promptly, /health fails, the server exits non-zero within 30 s. Ends the module's Llama server."""
    kill_child_mid_load(llama_server, "mmserve-tp1")


def test_llava_tp2_equals_hf(tmp_path_factory):
    model_dir = build_llava_hf(str(tmp_path_factory.mktemp("llava") / "llava-hf"))
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--enable_multimodal",
                        *tp_args())  # fmt: skip
    with serving(srv):
        jobs = [(llava.ONE_IMAGE, IMAGES[:1]), (llava.TWO_IMAGES, IMAGES), (llava.TEXT_ONLY, [])]
        answers = llava.generate_concurrently(srv, jobs, llava.NEW_TOKENS)
        expected = llava.hf_expected(model_dir, "llava_hf", jobs)
        assert [llava.ids(a) for a in answers] == [e for _, e in expected]


def test_qwen2_vl_tp2_equals_hf(tmp_path_factory):
    model_dir = build_qwen2_vl(str(tmp_path_factory.mktemp("qwen2_vl")))
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--enable_multimodal",
                        *tp_args())  # fmt: skip
    with serving(srv):
        cases = qwen_vl_cases.CASES  # one image, two non-square images, text only: batched together
        with ThreadPoolExecutor(len(cases)) as pool:
            ours = list(pool.map(lambda case: qwen_vl_cases.generate(srv, *case), cases))
    hf = qwen_vl_cases.hf_greedy_for(QWEN2_VL, model_dir)
    assert ours == [hf(*case) for case in cases]


def test_internvl2_5_internlm2_tp2_equals_hf(tmp_path_factory):
    """InternLM2's packed `wqkv` split by KV head over the ranks (8 query heads, 2 KV heads: 4 and 1 a rank)."""
    from transformers import AutoProcessor, InternVLForConditionalGeneration

    from mmserve.testing.checkpoints.internvl_internlm2 import build_internvl_internlm2
    from tests.e2e import test_internvl_server as internvl

    model_dir = build_internvl_internlm2(str(tmp_path_factory.mktemp("internvl_internlm2") / "m"))
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--enable_multimodal",
                        "--trust_remote_code", *tp_args())  # fmt: skip
    cases = internvl.GENERATE_CASES  # one image, two images of different tile counts, text only: batched together
    request = lambda case: internvl.generate(srv, internvl.request_text("internlm2", case[0]), case[1])  # noqa: E731
    with serving(srv), ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(request, cases))
    processor = AutoProcessor.from_pretrained(model_dir + "-hf")
    model = InternVLForConditionalGeneration.from_pretrained(model_dir + "-hf", dtype=torch.float32).eval()
    for (text, images), answer in zip(cases, answers, strict=True):
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        prompt = inputs["input_ids"][0].tolist()
        pixels = {"pixel_values": inputs["pixel_values"]} if images else {}
        assert answer["prompt_tokens"] == len(prompt), text
        assert [t["id"] for t in answer["tokens"]] == hf_greedy(model, prompt, internvl.NEW_TOKENS, **pixels), text


def test_gemma3_tp2_equals_hf(tmp_path_factory):
    """Gemma 3's 4 query heads and 2 KV heads split 2 and 1 a rank, its tied head by vocabulary rows; sliding and
    global layers, the image blocks (bidirectional) and 8-token prefill chunks around them on both ranks."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from mmserve.testing.checkpoints.gemma3 import build_gemma3
    from tests.e2e import test_gemma3_server as gemma3

    model_dir = build_gemma3(str(tmp_path_factory.mktemp("gemma3") / "m"))
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "server.log"), "--enable_multimodal",
                        "--chunked_prefill_size", "8", *tp_args())  # fmt: skip
    cases = gemma3.GENERATE_CASES  # one image, two images of different sizes, text only: batched together
    with serving(srv), ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: gemma3.generate(srv, *case), cases))
    processor = AutoProcessor.from_pretrained(model_dir)
    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    for (text, images), answer in zip(cases, answers, strict=True):
        prompt, expected = gemma3.hf_greedy(model, processor, text, images)
        assert answer["prompt_tokens"] == len(prompt), text
        assert [t["id"] for t in answer["tokens"]] == expected, text


def test_tp_that_does_not_divide_the_heads_fails_at_start(e2e_model_dir, tmp_path):
    """Refused by the parent from config.json before any child process starts (seconds, not a start-up's worth)."""
    srv = ServerProcess(e2e_model_dir, str(tmp_path / "server.log"), "--tp", "3", "--nccl_port", str(free_port()))
    assert srv.proc.wait(60) != 0
    log = srv.log()
    assert "cannot start: --tp 3 does not divide the model's 4 attention heads" in log  # the parent's own line
    assert "process failed to start" not in log  # not a child's
