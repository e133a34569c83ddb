"""The serving benchmark's pure logic: percentiles, TPOT method selection and figures from synthetic event timings,
event parsing for both servers' stream formats, and load selection. No server."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks.bench_stats import (
    LATENCY_MINUS_TTFT,
    PER_EVENT,
    RequestResult,
    one_event_per_token,
    percentile,
    request_tpot,
    summarize,
    tpot_method,
)
from benchmarks.loads import LOADS, build_prompt, requests_for, select_loads
from benchmarks.serve_bench import event_count, event_prompt_tokens


def per_token(ttft: float, step: float, n: int, tail: float = 0.001) -> RequestResult:
    """A stream with one event per token: first at `ttft`, then one every `step` seconds."""
    events = [(ttft + i * step, i + 1) for i in range(n)]
    return RequestResult(latency=events[-1][0] + tail, events=events, tokens=n, prompt_tokens=100)


def sparse(ttft: float, latency: float, n: int) -> RequestResult:
    """A stream whose tokens mostly decode to no text: one event with token 1, then only the final one."""
    return RequestResult(latency=latency, events=[(ttft, 1), (latency - 0.001, n)], tokens=n, prompt_tokens=100)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = [0.3, 1.7, 0.2, 5.0, 2.2, 2.2, 0.9]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edge_cases() -> None:
    assert percentile([4.0], 99) == 4.0
    assert math.isnan(percentile([], 50))


def test_one_event_per_token_uses_cumulative_counts() -> None:
    assert one_event_per_token(per_token(0.1, 0.01, 8))
    # as many events as tokens, but the counts skip: two tokens in one event, an empty event elsewhere
    skewed = RequestResult(latency=1, events=[(0.1, 2), (0.2, 2), (0.3, 3)], tokens=3)
    assert not one_event_per_token(skewed)
    # a server that gives no counts: the number of events decides
    assert one_event_per_token(RequestResult(latency=1, events=[(0.1, None), (0.2, None)], tokens=2))
    assert not one_event_per_token(sparse(0.1, 2.0, 8))


def test_tpot_per_event_when_every_request_streams_each_token() -> None:
    results = [per_token(0.5, 0.010, 128), per_token(0.7, 0.012, 128, tail=0.5)]
    assert tpot_method(results) == PER_EVENT
    # the slow stream close (tail) does not count: first event to last event over 127 gaps
    assert request_tpot(results[1], PER_EVENT) == pytest.approx(0.012)
    s = summarize(results, wall=2.0)
    assert s["tpot_method"] == PER_EVENT
    assert s["tpot_p50_ms"] == pytest.approx(11.0)
    assert s["itl_p50_ms"] == pytest.approx(10.0, rel=0.2)
    assert "ttft_caveat" not in s


def test_tpot_falls_back_when_any_request_is_sparse() -> None:
    results = [per_token(0.5, 0.010, 128), sparse(0.2, 0.2 + 127 * 0.02, 128)]
    assert tpot_method(results) == LATENCY_MINUS_TTFT
    s = summarize(results, wall=3.0)
    assert s["tpot_method"] == LATENCY_MINUS_TTFT
    assert "itl_p50_ms" not in s
    expected = [(r.latency - r.ttft) / 127 * 1e3 for r in results]
    assert s["tpot_p50_ms"] == pytest.approx(float(np.median(expected)))


def test_late_first_event_is_flagged() -> None:
    late = RequestResult(latency=2.0, headers=0.3, events=[(1.5, 40), (1.999, 128)], tokens=128)
    s = summarize([late, per_token(0.1, 0.01, 128)], wall=2.0)
    assert "ttft_caveat" in s and "1 of 2" in s["ttft_caveat"]
    assert s["headers_p50_s"] == pytest.approx(0.3)  # the per-token stream gave no headers time
    assert s["tpot_from_headers_p50_ms"] == pytest.approx((2.0 - 0.3) / 127 * 1e3)


def test_summary_throughput_and_errors() -> None:
    ok = [per_token(0.1 * i, 0.01, 16) for i in range(1, 5)]
    failed = RequestResult(latency=0.1, error="HTTP 500")
    s = summarize([*ok, failed], wall=2.0)
    assert s["num_requests"] == 5 and s["errors"] == 1 and s["first_error"] == "HTTP 500"
    assert s["req_per_s"] == pytest.approx(2.0)  # 4 finished in 2 s
    assert s["out_tok_per_s"] == pytest.approx(32.0)
    assert s["ttft_p50_s"] == pytest.approx(0.25)
    assert s["prompt_tokens_p50"] == 100 and s["output_tokens_min"] == 16
    assert json.dumps(s)  # one JSON line


def test_event_parsing_for_both_servers() -> None:
    ours = {"token": {"id": 5, "text": "a"}, "count_output_tokens": 7, "prompt_tokens": 249, "finished": False}
    lightllm = {"token": {"id": 5, "text": "a", "count_output_tokens": 7, "prompt_tokens": 249}, "finished": False}
    for event in (ours, lightllm):
        assert event_count(event) == 7 and event_prompt_tokens(event) == 249
    assert event_count({"token": {"text": ""}}) is None


def test_select_loads_and_overrides() -> None:
    assert [load.name for load in select_loads("all")] == list(LOADS)
    assert select_loads("none") == [] and select_loads("") == []
    picked = select_loads("one_336,img336_x256", num_requests=4, repeats=2, counts="img336_x256=8")
    assert [(load.name, load.num, load.concurrency) for load in picked] == [("one_336", 2, 1), ("img336_x256", 8, 8)]
    with pytest.raises(ValueError):
        select_loads("img999_x1")


def test_requests_same_image_and_text_twins() -> None:
    same, warm = requests_for(select_loads("img896_same_x64", num_requests=3)[0], "qwen2_vl", n_words=8)
    assert warm is not None and all(s.image_png == warm.image_png for s in same)
    assert len({s.prompt for s in [*same, warm]}) == 4  # distinct questions, the warming one included
    images, _ = requests_for(select_loads("img336_x64", num_requests=3)[0], "qwen2_vl", n_words=8)
    texts, _ = requests_for(select_loads("text_x64", num_requests=3)[0], "qwen2_vl", n_words=8)
    assert len({s.image_png for s in images}) == 3 and all(t.image_png is None for t in texts)
    for img, txt in zip(images, texts, strict=True):  # the same prompt with the image removed
        assert img.prompt.replace("<|vision_start|><|image_pad|><|vision_end|>", "") == txt.prompt
    body = json.loads(images[0].body(128))
    assert body["parameters"] == {"max_new_tokens": 128, "ignore_eos": True}
    assert body["multimodal_params"]["images"][0]["type"] == "base64"
    assert build_prompt("llava", "hi", True) == "USER: <image>\nhi ASSISTANT:"
