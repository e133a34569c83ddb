"""Host time per engine step, without the device: what the overlapped loop must hide behind the GPU.

    python benchmarks/host_step_bench.py

Times the host-side pieces of one step on a real EngineCore (tiny random Llama, CPU) with the model's forward out of
the clock: scheduling, staging (slot allocation + numpy inputs), packing into the one pinned input buffer, and
reading the samples back into the requests (behind the next step on the device, which is launched first, but for
an eager prompt step under the router: that one waits for it)."""

from __future__ import annotations

import tempfile
import time

import torch

from language.config import EngineConfig
from language.engine import EngineCore
from language.model_runner import InflightStep
from language.request import Request
from language.sampling_params import SamplingParams
from language.step_inputs import stage
from mmserve.testing.checkpoints.llama import build_llama


def _time(fn, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e6


def _measure(core: EngineCore, batch: int, chunk_tokens: int) -> tuple[float, ...]:
    params = SamplingParams(max_new_tokens=1000, ignore_eos=True)
    reqs = [Request(f"h{batch}-{chunk_tokens}-{i}", [5] * 32, params) for i in range(batch)]
    for r in reqs:
        core.add_request(r)
    while core.scheduler.waiting or any(r.prefilling for r in reqs):
        core.step()
    if chunk_tokens:  # a long prompt joins: its chunk rides in the same step as the decode rows
        core.add_request(Request(f"long-{batch}", [7] * (chunk_tokens + 100), params))
    sched, runner = core.scheduler, core.runner
    repeats = 20
    t_sched = _time(lambda: sched.schedule(lambda n: True), repeats)
    staged_steps = []

    def stage_one() -> None:
        staged_steps.append(stage(sched.schedule(lambda n: True), core.kv, 1, core.prefix))

    t_stage = _time(stage_one, repeats) - t_sched
    staged = staged_steps[-1]
    t_pack = _time(lambda: runner._batch(*runner._pack(staged), None), repeats)
    n = staged.num_seqs
    inflight = [
        InflightStep(
            [(r, i) for i, r in enumerate(staged.decode.reqs)],
            torch.zeros(n, dtype=torch.int64),
            torch.zeros(n),
            None,
            n,
            0,
            widths=(n, 0, 0, 0),
        )  # fmt: skip
        for _ in range(repeats)
    ]

    def read_back() -> None:
        core._collect(inflight.pop())

    t_read = _time(read_back, repeats)
    for r in list(core._requests.values()):
        core.abort(r.rid)
    while core.has_unfinished():
        core.step()
    return t_sched, t_stage, t_pack, t_read


def main() -> None:
    model_dir = build_llama(tempfile.mkdtemp())
    core = EngineCore(EngineConfig(model_dir=model_dir, max_total_token_num=400_000, device="cpu", cuda_graph=False))
    print("| step | schedule µs | stage µs | pack µs | read back µs | µs per decode row (all four) |")
    print("|---|---|---|---|---|---|")
    for batch, chunk in ((1, 0), (64, 0), (256, 0), (64, 2048)):
        with torch.inference_mode():  # as the engine runs
            t = _measure(core, batch, chunk)
        name = f"decode x{batch}" + (f" + a {chunk + 100}-token prompt" if chunk else "")
        print(f"| {name} | " + " | ".join(f"{x:.0f}" for x in t) + f" | {sum(t) / batch:.1f} |")


if __name__ == "__main__":
    main()
