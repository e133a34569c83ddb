"""The host-step benchmark runs against the engine as it is (it broke silently once when the engine's staging and
read-back grew arguments): each piece of a small decode step, and of one with a prompt chunk, is timed."""

from __future__ import annotations

import torch

from benchmarks.host_step_bench import _measure
from language.config import EngineConfig
from language.engine import EngineCore
from mmserve.testing.checkpoints.llama import build_llama


def test_times_every_piece_of_a_step(tmp_path) -> None:
    core = EngineCore(
        EngineConfig(model_dir=build_llama(str(tmp_path)), max_total_token_num=4096, device="cpu", cuda_graph=False)
    )
    with torch.inference_mode():
        for batch, chunk in ((4, 0), (4, 64)):
            times = _measure(core, batch, chunk)
            assert len(times) == 4 and times[0] > 0 and times[2] > 0 and times[3] > 0  # stage: minus schedule
    assert not core.has_unfinished()
