"""benchmarks/log_timeline.py reads the lines the server writes at --log_level debug (made here by a real router
and engine, formatted as the server formats them)."""

from __future__ import annotations

import logging

from benchmarks.log_timeline import parse_line, timeline
from language.config import EngineConfig
from language.engine import EngineCore
from language.sampling_params import SamplingParams
from mmserve.ipc.messages import TokenizedRequest
from mmserve.router.router import Router
from mmserve.testing.checkpoints.llama import build_llama


def test_the_timeline_of_a_served_request(tmp_path, caplog):
    core = EngineCore(
        EngineConfig(model_dir=build_llama(str(tmp_path / "llama")), max_total_token_num=64, device="cpu")
    )
    router = Router(core)
    caplog.set_level(logging.DEBUG)
    router.handle(TokenizedRequest("r", list(range(3, 9)), SamplingParams(max_new_tokens=3, ignore_eos=True)))
    while router.has_work():
        router.step()
    server_format = logging.Formatter("%(asctime)s router %(levelname)s %(message)s")  # as processes.py writes it
    lines = [server_format.format(r) for r in caplog.records]
    events = timeline(lines)
    steps = [e for e in events if e.kind == "step"]
    assert len(steps) == 3 and steps[0].what == "prefill=6 decode=0" and steps[1].what == "prefill=0 decode=1"
    assert all(e.start <= e.end for e in events)
    (first,) = [e for e in events if e.kind == "router"]
    assert first.what.startswith("first token") and first.start <= steps[0].start
    assert parse_line("2026-11-23 06:12:04,711 router INFO 223 steps (13.6 ms each)") is None
