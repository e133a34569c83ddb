"""Issue 29's additions to the serving benchmark: the mixed-length and Poisson loads (bounds, seeded reproducibility,
arrival times), the OpenAI request bodies and stream reading, and the OpenAI mode end to end against a real mmserve
server on a tiny Qwen2-VL checkpoint, beside the LightLLM mode on the same work."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import statistics
from dataclasses import replace

import pytest
from PIL import Image

from benchmarks.bench_client import run_concurrent
from benchmarks.bench_stats import RequestResult, summarize
from benchmarks.chat_loads import chat_conversations
from benchmarks.loads import (
    LOADS,
    arrival_times,
    build_prompt,
    poisson_arrivals,
    request_shapes,
    requests_for,
    select_loads,
    warmup_requests,
)
from benchmarks.openai_stream import read_chunk
from benchmarks.serve_bench import main, parse_args, run_load

MIXED = ("text_mixed_x256", "img_mixed_x64", "poisson12_x256")


def png_size(png: bytes) -> tuple[int, int]:
    return Image.open(io.BytesIO(png)).size


def test_mixed_loads_stay_within_their_bounds_and_vary() -> None:
    for name in MIXED:
        load = LOADS[name]
        shapes = request_shapes(load)
        assert len(shapes) == load.num == (64 if name == "img_mixed_x64" else 256)
        assert all(16 <= s.new_tokens <= 512 for s in shapes)
        assert len({s.new_tokens for s in shapes}) > load.num // 3  # spread, not a handful of values
        if load.word_range:
            assert all(16 <= s.words <= 512 for s in shapes) and len({s.words for s in shapes}) > load.num // 3
        else:
            assert {s.words for s in shapes} == {64}
        if load.size_range:
            sides = [side for s in shapes for side in s.image]
            assert 224 <= min(sides) < 400 and 1200 < max(sides) <= 1344
            assert load.image_sizes == {224, 1344} and load.max_images == 1
        else:
            assert all(s.image is None for s in shapes) and load.max_images == 0
    assert not any(LOADS[n].mixed for n in ("img336_x64", "text_x256", "one_896", "chat896_5turn"))


def test_mixed_requests_are_seeded_and_carry_their_lengths() -> None:
    load = select_loads("img_mixed_x64", num_requests=3)[0]
    specs, warm = requests_for(load, "qwen2_vl", n_words=8)
    again, _ = requests_for(load, "qwen2_vl", n_words=8)
    assert warm is None and specs == again  # byte-identical work in every run
    shapes = request_shapes(load)
    for spec, shape in zip(specs, shapes, strict=True):
        assert png_size(spec.image_png) == shape.image
        question = spec.messages[-1].text
        assert len(question.split()) == shape.words and spec.prompt == build_prompt("qwen2_vl", question, True)
        assert spec.max_new_tokens == shape.new_tokens
        assert json.loads(spec.body(128))["parameters"]["max_new_tokens"] == shape.new_tokens
        assert json.loads(spec.openai_body(128, None))["max_tokens"] == shape.new_tokens
    # a new image round: new images, the same lengths and sizes
    other, _ = requests_for(load, "qwen2_vl", n_words=8, image_round=1)
    assert [png_size(s.image_png) for s in other] == [s.image for s in shapes]
    assert not {s.image_png for s in other} & {s.image_png for s in specs}
    # the fixed-length loads' requests take the run's --max_new_tokens
    (fixed,), _ = requests_for(select_loads("text_x64", num_requests=1)[0], "qwen2_vl", n_words=8)
    assert fixed.max_new_tokens is None and json.loads(fixed.body(7))["parameters"]["max_new_tokens"] == 7
    # the warm-up covers the smallest and largest side of a mixed-size load
    warm_sizes = {png_size(s.image_png) for s in warmup_requests([load], "qwen2_vl", n_words=4)}
    assert warm_sizes == {(224, 224), (1344, 1344)}


def test_poisson_arrivals_have_the_rate_and_the_spread_of_a_poisson_process() -> None:
    times = poisson_arrivals(12.0, 20_001, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 12, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / 12, rel=0.05)  # exponential gaps: std = mean
    assert poisson_arrivals(12.0, 50, seed=1) == times[:50] and poisson_arrivals(12.0, 50, seed=2) != times[:50]
    load = LOADS["poisson12_x256"]
    sent = arrival_times(load)
    assert sent == arrival_times(load) and len(sent) == 256
    assert (len(sent) - 1) / sent[-1] == pytest.approx(12.0, rel=0.15)  # ~21 s of arrivals at 12 req/s
    assert arrival_times(LOADS["img336_x64"]) is None


def test_openai_body_is_the_lightllm_request_as_chat_messages() -> None:
    (spec,), _ = requests_for(select_loads("img336_x64", num_requests=1)[0], "qwen2_vl", n_words=8)
    body = json.loads(spec.openai_body(16, "model"))
    assert body["model"] == "model" and body["max_tokens"] == 16 and body["temperature"] == 0
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    system, user = body["messages"]
    assert system == {"role": "system", "content": "You are a helpful assistant."}
    image, text = user["content"]
    prefix = "data:image/png;base64,"
    assert image["image_url"]["url"].startswith(prefix)
    assert base64.b64decode(image["image_url"]["url"][len(prefix) :]) == spec.image_png
    assert spec.prompt == build_prompt("qwen2_vl", text["text"], True)
    assert "model" not in json.loads(spec.openai_body(16, None))
    (llava,), _ = requests_for(select_loads("text_x64", num_requests=1)[0], "llava", n_words=8)
    assert [m["role"] for m in json.loads(llava.openai_body(4, None))["messages"]] == ["user"]
    # a chat's later turn: every turn's question, the answers between, images on their turns
    conv = chat_conversations(select_loads("chat896_5turn", counts="chat896_5turn=1")[0], "qwen2_vl", n_words=4)[0]
    messages = json.loads(conv.request(["a1", "a2"]).openai_body(8, None))["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in messages if m["role"] == "assistant"] == ["a1", "a2"]
    assert [isinstance(m["content"], list) for m in messages[1::2]] == [True, False, True]


def test_stream_chunks_fold_into_a_result() -> None:
    r = RequestResult()
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    usage = {"prompt_tokens": 30, "completion_tokens": 1}
    assert not read_chunk(r, {**role, "usage": {**usage, "completion_tokens": 0}}, 0.10)
    assert not read_chunk(r, {"choices": [{"index": 0, "delta": {"content": "a"}}], "usage": usage}, 0.11)
    two = {"prompt_tokens": 30, "completion_tokens": 3}  # a token without text rode along
    assert read_chunk(
        r, {"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "length"}], "usage": two}, 0.2
    )
    assert not read_chunk(r, {"choices": [], "usage": two}, 0.21)
    assert (r.first_chunk, r.events, r.text, r.tokens, r.prompt_tokens) == (0.10, [(0.11, 1), (0.2, 3)], "ab", 3, 30)
    r.latency = 0.22
    s = summarize([r], wall=0.22)
    assert s["ttft_p50_s"] == pytest.approx(0.11) and s["first_chunk_p50_s"] == pytest.approx(0.10)
    assert s["tpot_method"] == "latency_minus_ttft" and "no_text_requests" not in s


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("transformers")
    from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
    from mmserve.testing.server_proc import ServerProcess, serving

    model_dir = build_qwen2_vl(str(tmp_path_factory.mktemp("q2vl") / "tiny-q2vl"))
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    srv = ServerProcess(model_dir, log, "--max_total_token_num", "4096", "--enable_multimodal")
    with serving(srv):
        yield srv


@pytest.mark.slow
def test_openai_mode_gives_the_lightllm_modes_answers(server) -> None:
    """The same requests through /v1/chat/completions and /generate_stream: the same prompt lengths (the checkpoint's
    chat template renders the messages as build_prompt writes the prompt), the same greedy text, every token."""
    specs, _ = requests_for(select_loads("img336_x64", num_requests=2)[0], "qwen2_vl", n_words=6)
    specs += requests_for(select_loads("text_x64", num_requests=1)[0], "qwen2_vl", n_words=6)[0]
    via = {}
    for api, bodies in (
        ("lightllm", [s.body(5) for s in specs]),
        ("openai", [s.openai_body(5, "tiny-q2vl") for s in specs]),
    ):
        via[api], _, _ = asyncio.run(run_concurrent(server.url, bodies, api, 60, progress=False, api=api))
    for lightllm, openai in zip(via["lightllm"], via["openai"], strict=True):
        assert lightllm.error is None and openai.error is None, (lightllm.error, openai.error)
        assert openai.tokens == lightllm.tokens == 5
        assert openai.prompt_tokens == lightllm.prompt_tokens
        assert openai.text == lightllm.text
        assert 0 < openai.first_chunk <= openai.ttft <= openai.latency
    assert via["openai"][0].prompt_tokens > via["openai"][2].prompt_tokens  # the image's tokens
    assert any(r.text for r in via["openai"])  # text was compared, not only empty answers


@pytest.mark.slow
def test_openai_mode_end_to_end_lines_and_poisson_arrivals(server, capsys) -> None:
    main(["--url", server.url, "--api", "openai", "--loads", "img336_x64,text_one", "--num_requests", "3"]
         + ["--repeats", "2", "--max_new_tokens", "4", "--question_words", "6", "--no_warmup"])  # fmt: skip
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["load"], x["api"], x["num_requests"]) for x in lines] == [
        ("img336_x64", "openai", 3),
        ("text_one", "openai", 2),
    ]
    for x in lines:
        assert "errors" not in x and "short_requests_caveat" not in x, x
        assert x["output_tokens_min"] == 4 and x["req_per_s"] > 0 and x["tpot_p50_ms"] > 0
        # each request's first chunk comes no later than its first text, and that no later than its end
        assert (
            0 < x["first_chunk_p50_s"] <= x["ttft_p50_s"] <= x["latency_p50_s"] and x["ttft_p50_s"] <= x["ttft_p99_s"]
        )
    # Poisson arrivals over two client processes, mixed sizes and lengths (kept tiny for the CPU)
    load = replace(LOADS["poisson12_x256"], num=5, rate=25.0, size_range=(56, 120), new_token_range=(2, 5))
    args = parse_args(["--api", "openai", "--model_name", "tiny-q2vl", "--client_procs", "2", "--question_words", "4"])
    summary = run_load(server.url, load, "qwen2_vl", args)
    asked = sum(s.new_tokens for s in request_shapes(load))
    assert "errors" not in summary and "short_requests_caveat" not in summary, summary
    assert summary["new_tokens_asked"] == asked and summary["out_tok_per_s"] * summary["wall_s"] == pytest.approx(asked)
    assert summary["arrival_rate_per_s"] == 25.0 and summary["wall_s"] > summary["arrivals_span_s"] > 0
    # a wrong model name is the server's 404, reported as errors
    wrong = run_load(
        server.url,
        replace(LOADS["text_x64"], num=1),
        "qwen2_vl",
        parse_args(["--api", "openai", "--model_name", "nope", "--max_new_tokens", "2"]),
    )
    assert wrong["errors"] == 1 and "404" in wrong["first_error"]


def test_hf_baseline_skips_the_mixed_loads() -> None:
    hf_baseline = pytest.importorskip("benchmarks.hf_baseline")
    # no checkpoint is read when every load is skipped: the model is never loaded
    lines = list(hf_baseline.run_hf_loads("qwen2_vl", "/nonexistent", [LOADS[n] for n in MIXED], 8, 4))
    assert [line["load"] for line in lines] == list(MIXED) and all("mixed" in line["skipped"] for line in lines)
