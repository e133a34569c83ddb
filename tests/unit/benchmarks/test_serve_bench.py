"""The serving benchmark's pure logic: percentiles, TPOT method selection and figures from synthetic event timings,
event parsing for both servers' stream formats, load selection, and the multi-turn chat load's prompts and per-turn
figures. No server."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from benchmarks.bench_client import event_count, event_prompt_tokens, event_text
from benchmarks.bench_stats import (
    LATENCY_MINUS_TTFT,
    PER_EVENT,
    RequestResult,
    by_turn,
    one_event_per_token,
    percentile,
    request_tpot,
    summarize,
    tpot_method,
)
from benchmarks.chat_loads import ChatTurn, chat_conversations, chat_prompt
from benchmarks.json_schema_load import OBJECTS_SCHEMA, load_schema
from benchmarks.loads import (
    FAMILIES,
    LOADS,
    build_prompt,
    requests_for,
    select_loads,
    warmup_requests,
)
from benchmarks.serve_bench import parse_args
from mmserve.http.protocol import parse_parameters

QWEN_MARK = "<|vision_start|><|image_pad|><|vision_end|>"


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
    event = {"token": {"id": 5, "text": "a", "count_output_tokens": 7, "prompt_tokens": 249}, "finished": False}
    assert event_count(event) == 7 and event_prompt_tokens(event) == 249
    assert event_count({"token": {"text": ""}}) is None


def test_select_loads_and_overrides() -> None:
    assert [load.name for load in select_loads("all")] == list(LOADS)
    assert select_loads("none") == [] and select_loads("") == []
    picked = select_loads("one_336,img336_x256", num_requests=4, repeats=2, counts="img336_x256=8")
    assert [(load.name, load.num, load.concurrency) for load in picked] == [("one_336", 2, 1), ("img336_x256", 8, 8)]
    with pytest.raises(ValueError):
        select_loads("img999_x1")


def test_image_rounds_give_new_images_and_the_same_questions() -> None:
    load = select_loads("img336_x64", num_requests=2)[0]
    first, _ = requests_for(load, "qwen2_vl", n_words=8)
    again, _ = requests_for(load, "qwen2_vl", n_words=8, image_round=0)
    second, _ = requests_for(load, "qwen2_vl", n_words=8, image_round=1)
    assert first == again
    assert [s.prompt for s in first] == [s.prompt for s in second]
    assert not {s.image_png for s in first} & {s.image_png for s in second}


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


def chat_load(num: int = 2):
    return select_loads("chat896_5turn", counts=f"chat896_5turn={num}")[0]


def test_chat_load_selection() -> None:
    assert "chat896_5turn" in [load.name for load in select_loads(None)]
    load = chat_load(1)
    assert load.is_chat and load.turns == 5 and load.num == 1 and load.image_sizes == {896, 336}
    assert select_loads("chat896_5turn", num_requests=3)[0].num == 3  # conversations, as any concurrent load's count
    assert not LOADS["img896_x64"].is_chat and LOADS["img896_x64"].turns == 1
    with pytest.raises(ValueError, match="multi-turn"):
        requests_for(load, "qwen2_vl")
    # the warm-up covers the third turn's 336 px image too
    sizes = sorted(len(s.image_png or b"") for s in warmup_requests([load], "qwen2_vl", n_words=4))
    assert len(set(sizes)) == 2


def test_chat_history_carries_answers_and_images_in_order() -> None:
    convs = chat_conversations(chat_load(2), "qwen2_vl", n_words=8)
    conv = convs[0]
    answers = ["first answer", "second answer", "third", "fourth"]
    first = conv.request([])
    # turn 1 is a one-turn request of the other loads: question 0, the same chat format
    assert first.prompt == build_prompt("qwen2_vl", conv.turns[0].question, True)
    assert first.images == [conv.turns[0].image_png]
    prev = first.prompt
    for k in range(1, 5):
        spec = conv.request(answers[:k])
        # the previous request's prompt, its answer closing the assistant turn, then the new user turn
        assert spec.prompt.startswith(prev + answers[k - 1] + "<|im_end|>\n<|im_start|>user\n")
        assert spec.prompt.endswith(conv.turns[k].question + "<|im_end|>\n<|im_start|>assistant\n")
        assert all(a in spec.prompt for a in answers[:k])
        expected = [conv.turns[0].image_png] + ([conv.turns[2].image_png] if k >= 2 else [])
        assert spec.images == expected and spec.prompt.count(QWEN_MARK) == len(expected)
        body = json.loads(spec.body(128))
        assert len(body["multimodal_params"]["images"]) == len(expected)
        prev = spec.prompt
    # the second image's mark opens turn 3's user message, after the second answer
    last = conv.request(answers)
    assert last.prompt.index(answers[1]) < last.prompt.index(QWEN_MARK + conv.turns[2].question)
    with pytest.raises(ValueError):
        conv.request(answers + ["fifth"])
    # images: 896 then 336 px, distinct across conversations and from the other loads'
    assert conv.turns[1].image_png is None and conv.turns[2].image_png is not None
    assert len(conv.turns[0].image_png) > len(conv.turns[2].image_png)
    other, _ = requests_for(select_loads("img896_x64", num_requests=2)[0], "qwen2_vl", n_words=8)
    pngs = [t.image_png for c in convs for t in c.turns if t.image_png] + [s.image_png for s in other]
    assert len(set(pngs)) == len(pngs) == 6
    assert len({c.turns[k].question for c in convs for k in range(5)}) == 10
    # deterministic: a second build gives byte-identical requests
    again = chat_conversations(chat_load(2), "qwen2_vl", n_words=8)[0]
    assert again.request(answers[:3]).body(128) == conv.request(answers[:3]).body(128)


def test_chat_prompt_llava_and_placeholders_in_answers() -> None:
    turns = [ChatTurn("q1", b"png1"), ChatTurn("q2", None), ChatTurn("q3", b"png2")]
    assert chat_prompt("llava", turns[:1], []) == build_prompt("llava", "q1", True)
    assert chat_prompt("llava", turns, ["a1", "a2"]) == (
        "USER: <image>\nq1 ASSISTANT: a1</s>USER: q2 ASSISTANT: a2</s>USER: <image>\nq3 ASSISTANT:"
    )
    with pytest.raises(ValueError):
        chat_prompt("qwen2_vl", turns, ["a1"])
    # an answer that spells an image placeholder does not add an image mark to the history
    conv = chat_conversations(chat_load(1), "qwen2_vl", n_words=4)[0]
    spec = conv.request(["x" + QWEN_MARK + "y"])
    assert spec.prompt.count(QWEN_MARK) == 1 and "xy<|im_end|>" in spec.prompt


def test_event_text_for_both_servers() -> None:
    event = {"token": {"id": 5, "text": "ab", "count_output_tokens": 7}, "generated_text": None}
    assert event_text(event) == "ab"
    assert event_text({"token": {"id": 5, "text": None}}) == "" and event_text({}) == ""


def test_by_turn_groups_results_per_turn() -> None:
    def turn(ttft: float, prompt: int, headers: float | None = None) -> RequestResult:
        r = per_token(ttft, 0.01, 4)
        r.prompt_tokens, r.headers = prompt, headers
        return r

    convs = [
        [turn(0.5, 1100), turn(0.05, 1300, 0.04), turn(0.2, 1600)],
        [turn(0.7, 1120), turn(0.07, 1330, 0.06), RequestResult(error="HTTP 500")],
        [turn(0.9, 1140), RequestResult(error="boom"), RequestResult(error="not sent: turn 2 failed")],
    ]
    out = by_turn(convs, with_headers=True)
    assert out["ttft_by_turn_ms"] == [700.0, 60.0, 200.0]
    assert out["prompt_tokens_by_turn"] == [1120, 1315, 1600]
    assert out["finished_by_turn"] == [3, 2, 1]
    assert out["headers_by_turn_ms"] == [None, 50.0, None]
    assert by_turn([[turn(0.1, 10), RequestResult(error="x")]])["ttft_by_turn_ms"] == [100.0, None]
    assert "headers_by_turn_ms" not in by_turn(convs)
    assert json.dumps(out)


def test_hf_baseline_skips_chat_loads() -> None:
    hf_baseline = pytest.importorskip("benchmarks.hf_baseline")
    # no checkpoint is read when every load is a chat: the model is never loaded
    lines = list(hf_baseline.run_hf_loads("qwen2_vl", "/nonexistent", [chat_load(1)], 8, 4))
    assert lines == [{"load": "chat896_5turn", "skipped": lines[0]["skipped"]}] and "chat" in lines[0]["skipped"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_later_qwen_family_prompts(family: str) -> None:
    """Qwen2.5-VL and Qwen3-VL: ChatML with Qwen2-VL's vision block, so the Qwen families get byte-identical
    requests."""
    assert family in FAMILIES and parse_args(["--family", family]).family == family
    assert build_prompt(family, "hi", True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{QWEN_MARK}hi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert build_prompt(family, "hi", False) == build_prompt("qwen2_vl", "hi", False)
    assert QWEN_MARK not in build_prompt(family, "hi", False)
    for name in ("img336_x64", "img896_same_x64", "text_x64", "one_896"):
        load = select_loads(name, num_requests=3, repeats=2)[0]
        assert requests_for(load, family, n_words=8) == requests_for(load, "qwen2_vl", n_words=8)
    warm = warmup_requests([LOADS["img336_x64"], LOADS["text_x64"]], family, n_words=4)
    assert [s.prompt.count(QWEN_MARK) for s in warm] == [0, 0, 1, 1]
    # chats: the same history format, and an answer spelling the vision block does not add an image
    conv = chat_conversations(chat_load(1), family, n_words=4)[0]
    twin = chat_conversations(chat_load(1), "qwen2_vl", n_words=4)[0]
    answers = ["a" + QWEN_MARK + "b", "c"]
    assert conv.request(answers).body(16) == twin.request(answers).body(16)
    spec = conv.request(answers[:1])
    assert spec.prompt.count(QWEN_MARK) == 1 and "ab<|im_end|>" in spec.prompt


@pytest.fixture(scope="module")
def tiny_qwen_vl(tmp_path_factory):
    """Tiny random checkpoints of the Qwen2-VL generations (CPU, float32)."""
    pytest.importorskip("transformers")
    from mmserve.testing.checkpoints.qwen2_5_vl import build_qwen2_5_vl
    from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
    from mmserve.testing.checkpoints.qwen3_vl import build_qwen3_vl

    root = tmp_path_factory.mktemp("qwen_vl")
    return {
        "qwen2_vl": build_qwen2_vl(str(root / "q2vl")),
        "qwen2_5_vl": build_qwen2_5_vl(str(root / "q25vl")),
        "qwen3_vl": build_qwen3_vl(str(root / "q3vl")),
    }


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_hf_baseline_batched_equals_alone_with_mrope(family: str, tiny_qwen_vl: dict) -> None:
    """HF's batched greedy (left-padded) gives each request the tokens it gets alone, and the batch carries the
    image-token mask, so generate uses M-RoPE (non-zero rope deltas) rather than falling back to 1-D positions."""
    hf_baseline = pytest.importorskip("benchmarks.hf_baseline")
    runner = hf_baseline.HFRunner(family, tiny_qwen_vl[family])
    (a,), _ = requests_for(select_loads("img336_x64", num_requests=1)[0], family, n_words=40)
    (b,), _ = requests_for(select_loads("img896_x64", num_requests=1)[0], family, n_words=6)
    items = [runner.item(a), runner.item(b)]
    widths = [it["input_ids"].shape[1] for it in items]
    assert widths[0] > widths[1]  # the second request is left-padded in the batch
    if runner.takes_mm_types:
        batch = runner.collate(items)
        assert {"input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"} <= set(batch)
        types = batch["mm_token_type_ids"].cpu()
        pad = widths[0] - widths[1]
        assert types[1, :pad].sum() == 0 and torch.equal(types[1, pad:], items[1]["mm_token_type_ids"][0])
        image_id = runner.model.config.image_token_id
        assert torch.equal(types.bool(), (batch["input_ids"].cpu() == image_id) & batch["attention_mask"].cpu().bool())
    alone = [runner.greedy([it], 5)[0] for it in items]
    together = runner.greedy(items, 5)
    assert together == alone
    if runner.takes_mm_types:
        deltas = runner.model.model.rope_deltas.flatten().tolist()
        assert len(deltas) == 2 and all(d < 0 for d in deltas)  # images take fewer positions than tokens


def test_tp_parity_judges_divergences_by_the_logprob_rule() -> None:
    """tp_parity's line: identical answers, equal tokens (also after a divergence), where each differing answer first
    differs, and vLLM's rule there: each side's token among the other's top 5, with the larger of the two gaps."""
    from benchmarks.tp_parity import Position, compare

    def pos(token: str, logprob: float, **others: float) -> Position:
        return Position(token, logprob, {token: logprob, **others})

    a = [[pos("x", -0.1), pos("y", -0.7, z=-0.72), pos("w", -0.2)], [pos("p", -0.5), pos("q", -0.3)]]
    b = [[pos("x", -0.1), pos("z", -0.69, y=-0.70), pos("w", -0.2)], [pos("p", -0.5), pos("q", -0.3)]]
    line = compare("tp1 vs tp2", a, b)
    assert (line["identical_answers"], line["first_divergence"]) == (1, [1])
    assert line["logprob_rule_holds"] == 2 and line["worst_gap"] == line["divergence_gaps"][0] == 0.02
    assert line["equal_token_fraction"] == 4 / 5 and compare("same", a, a)["first_divergence"] == []
    c = [[pos("x", -0.1), pos("v", -0.05), pos("w", -0.2)], [pos("p", -0.5), pos("q", -0.3)]]  # y is not in c's top
    broken = compare("tp1 vs tp2", a, c)
    assert broken["logprob_rule_holds"] == 1 and broken["divergence_gaps"] == [None] and broken["worst_gap"] is None


def test_json_schema_option_constrains_every_body(tmp_path) -> None:
    assert parse_args([]).json_schema is None and load_schema(None) is None
    assert parse_args(["--json_schema", "builtin"]).json_schema == "builtin"
    assert load_schema("builtin") is OBJECTS_SCHEMA
    path = tmp_path / "schema.json"
    path.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert load_schema(str(path))["properties"] == {"a": {"type": "integer"}}
    (spec,), _ = requests_for(select_loads("one_336", None, 1, None)[0], "qwen2_vl")
    plain, constrained = json.loads(spec.body(128)), json.loads(spec.body(128, OBJECTS_SCHEMA))
    assert constrained["parameters"].pop("guided_json") == OBJECTS_SCHEMA
    assert constrained == plain  # the same load otherwise
    # mmserve's /generate takes it: the schema compiles (xgrammar) and becomes the request's constraint
    assert parse_parameters(constrained["parameters"] | {"guided_json": OBJECTS_SCHEMA}).structured.kind == "json"


def test_sampling_option_samples_every_body() -> None:
    """--sampling top_p: temperature 0.7 and top-p 0.9 without a top-k on both APIs, which mmserve's /generate
    parses into a sampled request (the nucleus draw); greedy by default."""
    assert parse_args([]).sampling == "greedy" and parse_args(["--sampling", "top_p"]).sampling == "top_p"
    (spec,), _ = requests_for(select_loads("text_x64", 1, 1, None)[0], "qwen2_vl")
    greedy, sampled = json.loads(spec.body(16)), json.loads(spec.body(16, sampling="top_p"))
    assert parse_parameters(greedy["parameters"]).greedy
    params = parse_parameters(sampled["parameters"])
    assert not params.greedy and (params.temperature, params.top_p, params.top_k) == (0.7, 0.9, -1)
    chat = json.loads(spec.openai_body(16, None, sampling="top_p"))
    assert (chat["temperature"], chat["top_p"]) == (0.7, 0.9) and "top_k" not in chat
    assert json.loads(spec.openai_body(16, None))["temperature"] == 0
