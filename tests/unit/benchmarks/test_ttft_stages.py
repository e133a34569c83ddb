"""benchmarks/ttft_stages.py on lines in the formats the server writes at --log_level debug (taken from a server's
log): two requests of one burst, a lone request a few seconds later, and the router's steps."""

from __future__ import annotations

import pytest

from benchmarks.ttft_stages import (
    burst_phases,
    burst_stages,
    bursts,
    describe_phases,
    prompt_step_host_gaps,
    requests_and_steps,
    single_request_stages,
    tower_batches,
)


def _request(rid: str, start: float, read: float, wait: float, arrived: float, first_ms: float) -> list[str]:
    return [
        f"2026-11-23 09:05:21,434 mmserve.prep.multimodal.preparer DEBUG image request timing: rid={rid} images=1 "
        f"load_hash_ms=23.8 prompt_ms=15.4 encode_wait_ms={wait} total_ms=107.7",
        f"2026-11-23 09:05:21,435 mmserve.http.server DEBUG request timing: rid={rid} bytes=452915 read_ms={read} "
        f"parse_ms=2.0 prepare_ms=111.2 total_ms=118.8 start={start}",
        f"2026-11-23 09:05:21,500 router DEBUG router timing: rid={rid} arrived={arrived} first_token_ms={first_ms} "
        "cached=0",
    ]


LINES = [
    *_request("a", 100.0, 5.0, 60.0, 100.2, 50.0),
    *_request("b", 100.1, 7.0, 80.0, 100.3, 150.0),
    *_request("c", 105.0, 6.0, 70.0, 105.1, 40.0),
    "2026-11-23 09:05:21,501 router DEBUG step timing: launched=100.21 collected=100.25 prefill_tokens=249 decode=0",
    "2026-11-23 09:05:21,502 router DEBUG step timing: launched=100.26 collected=100.27 prefill_tokens=0 decode=1",
    "2026-11-23 09:05:21,503 router DEBUG step timing: launched=100.31 collected=100.44 prefill_tokens=249 decode=1",
    "2026-11-23 09:05:21,504 mmserve.http.server INFO 127.0.0.1 POST /generate_stream 200",
    "2026-11-23 09:05:21,505 mmserve.http.server DEBUG request timing: rid=text bytes=9 read_ms=1 parse_ms=1 "
    "prepare_ms=1 total_ms=3 start=100.05",  # never reached the router: left out
]


def test_stages_of_a_burst() -> None:
    reqs, steps = requests_and_steps(LINES)
    assert sorted(reqs) == ["a", "b", "c"]
    first, lone = bursts(reqs)
    assert len(first) == 2 and len(lone) == 1
    stages = burst_stages(first)
    assert stages["start"] == pytest.approx([0.0, 0.1])
    assert stages["read+parse"] == pytest.approx([0.007, 0.009])
    assert stages["image+prompt"] == pytest.approx([0.0392, 0.0392])
    assert stages["encode wait"] == pytest.approx([0.06, 0.08])
    assert stages["first token"] == pytest.approx([0.25, 0.45])  # arrival in the router + its first token
    # prompt steps only, each from the previous step's read-back: 100.27 -> 100.31
    assert prompt_step_host_gaps(steps, 100.0, 100.5) == pytest.approx([0.04])


def test_stages_of_a_lone_request() -> None:
    """Request c (HTTP start 105.0, read+parse 8 ms, load+hash 23.8 ms) and the tower batch that took its image."""
    tower = (
        "2026-11-23 09:05:26,101 visual DEBUG tower batch: start=105.060 encoded=105.080 done=105.085 images=1 "
        "tokens=1024 patches=4096 first_arrived=105.0338 decode_ms=9.0 preprocess_ms=5.0"
    )
    earlier = tower.replace("first_arrived=105.0338", "first_arrived=100.01")  # burst a/b's batch
    reqs, _ = requests_and_steps(LINES)
    stages = single_request_stages(reqs["c"], tower_batches([earlier, tower]))
    assert list(stages) == ["read+parse", "load+hash", "to visual", "decode", "preprocess", "pool hand-off", "tower",
                            "write", "back to router", "router", "server total"]  # fmt: skip
    expected = [0.008, 0.0238, 0.002, 0.009, 0.005, 0.0122, 0.02, 0.005, 0.015, 0.04, 0.14]
    assert list(stages.values()) == pytest.approx(expected, abs=1e-6)
    assert single_request_stages(reqs["c"], []).keys() == {"read+parse", "load+hash", "router", "server total"}


def test_phases_of_a_burst() -> None:
    """Burst a/b (first start 100.0, the next burst at 105.0): one tower batch, a prompt step, a decode step, a
    second prompt step read back at 100.44, then a tail of three decode steps; the lone request's step (at 105.2)
    and tower batch belong to the next burst."""
    tower = (
        "2026-11-23 09:05:21,300 visual DEBUG tower batch: start=100.050 encoded=100.110 done=100.115 images=2 "
        "tokens=288 patches=1152 first_arrived=100.03 decode_ms=9.0 preprocess_ms=5.0"
    )
    later_tower = tower.replace("start=100.050 encoded=100.110", "start=105.050 encoded=105.070")
    tail = [
        f"2026-11-23 09:05:21,6{i}0 router DEBUG step timing: launched={t} collected={t + 0.005:.3f} prefill_tokens=0 "
        "decode=2"
        for i, t in enumerate((100.445, 100.452, 100.461))
    ]
    lone_step = (
        "2026-11-23 09:05:26,200 router DEBUG step timing: launched=105.2 collected=105.21 prefill_tokens=9 decode=0"
    )
    reqs, steps = requests_and_steps([*LINES, *tail, lone_step])
    first, lone = bursts(reqs)
    towers = tower_batches([tower, later_tower])
    p = burst_phases(first[0]["http_start"], lone[0]["http_start"], steps, towers)
    assert p.first_tower == pytest.approx(0.05) and p.first_step == pytest.approx(0.21)
    assert p.prompt_end == pytest.approx(0.44) and (p.prompt_steps, p.prompt_tokens) == (2, 498)
    assert p.tail_end == pytest.approx(0.466) and p.tail_steps == 3
    assert p.tail_step_p50 == pytest.approx(0.008)  # spacings 7 and 9 ms
    assert (p.tower_images, p.tower_batches) == (2, 1) and p.tower_busy == pytest.approx(0.06)
    assert "first tower batch at 50 ms" in describe_phases(p)
    q = burst_phases(lone[0]["http_start"], float("inf"), steps, [])
    assert q.first_tower is None and q.tail_steps == 0 and q.tail_step_p50 is None
    assert "no tower batch" in describe_phases(q)
    assert burst_phases(200.0, 300.0, steps, towers) is None
