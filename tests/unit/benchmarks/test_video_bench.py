"""The video benchmark (benchmarks/video_bench.py) end to end on CPU, shrunk (2 clips of 2 s, 112x84, 4 new tokens):
against a real mmserve on a tiny Qwen2-VL through both APIs, then HF transformers on the same clips, so that the
script the GPU run relies on cannot silently break. Both servers' lines carry every stage, and the prompts are the
same length through both APIs and HF's processor (the same frames sampled, the same template)."""

from __future__ import annotations

import json

import pytest

from benchmarks.video_bench import histogram_totals, main, stage_deltas

SMALL = ["--loads", "video16_30s", "--num_requests", "2", "--clip_seconds", "2", "--clip_size", "112x84",
         "--clip_fps", "8,10", "--max_new_tokens", "4", "--question_words", "4"]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl

    return build_qwen2_vl(str(tmp_path_factory.mktemp("q2vl") / "tiny-q2vl"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from mmserve.testing.server_proc import ServerProcess, serving

    log = str(tmp_path_factory.mktemp("log") / "server.log")
    srv = ServerProcess(model_dir, log, "--max_total_token_num", "4096", "--enable_multimodal")
    with serving(srv):
        yield srv


def test_histogram_totals_read_labelled_samples_of_either_server() -> None:
    text = "\n".join([
        "# HELP mmserve_vision_tower_seconds x",
        'mmserve_vision_tower_seconds_bucket{kind="video",le="0.1"} 1.0',
        'mmserve_vision_tower_seconds_sum{kind="video"} 0.5',
        'mmserve_vision_tower_seconds_count{kind="video"} 2.0',
        'mmserve_vision_tower_seconds_sum{kind="image"} 7.0',
        'mmserve_vision_tower_seconds_count{kind="image"} 9.0',
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 1.5',
        'vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 3.0',
    ])  # fmt: skip
    assert histogram_totals(text, "mmserve_vision_tower_seconds", 'kind="video"') == (0.5, 2.0)
    assert histogram_totals(text, "request_prefill_time_seconds") == (1.5, 3.0)
    assert histogram_totals(text, "request_decode_time_seconds") is None
    later = text.replace("} 0.5", "} 1.5").replace('video"} 2.0', 'video"} 4.0')
    stages = stage_deltas(text, later)
    assert stages["tower"] == {"mean_s": 0.5, "sum_s": 1.0, "count": 2}
    assert stages["prefill"] == {"mean_s": None, "sum_s": 0.0, "count": 0} and stages["decode"] is None


@pytest.mark.slow
def test_video_bench_end_to_end_through_both_apis_and_hf(server, model_dir, tmp_path, capsys) -> None:
    clips = ["--clip_dir", str(tmp_path / "clips")]
    main(["--url", server.url, "--model_dir", model_dir, "--hf", "--hf_batch", "2", *SMALL, *clips])
    main(["--url", server.url, "--api", "lightllm", "--no_warmup", "--seed", "7", *SMALL, *clips])
    served, hf, lightllm = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (served["server"], served["api"], hf["server"], lightllm["api"]) == ("mmserve", "openai", "hf", "lightllm")
    for line in (served, lightllm):
        assert "errors" not in line and "short_requests_caveat" not in line, line
        assert line["num_requests"] == 2 and line["output_tokens_min"] == 4
        assert 0 < line["ttft_p50_s"] <= line["latency_p50_s"] and line["tpot_p50_ms"] > 0
        for stage in ("decode_sample", "tower", "queue", "prefill", "decode"):
            figures = line["stages"][stage]
            assert figures["count"] == 2 and figures["sum_s"] > 0, (stage, figures)
        assert line["clips"] == 2 and line["clip_size"] == "112x84" and line["sampling"] == {"fps": 2.0}
    # the same work: HF's processor expands the same prompt to as many tokens as the server, through either API
    assert served["prompt_tokens_p50"] == hf["prompt_tokens_p50"] == lightllm["prompt_tokens_p50"]
    assert hf["num_requests"] == 2 and hf["hf_batch"] == 2 and hf["req_per_s"] > 0
    stages = hf["stages_s"]
    assert all(stages[k] > 0 for k in ("decode_sample", "processor", "tower", "decode")), stages
    assert stages["prefill"] >= 0  # to the first logits, less the tower: within the noise of the tiny model on CPU
