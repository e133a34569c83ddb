"""Host time of the launchers' shared checks (language/kernels/launch_utils.py), which run on every Triton launch:
an eager prompt step makes ~11 launches a layer, and py-spy put the checks at ~17 % of its host time.

    python benchmarks/launch_checks_bench.py

CPU tensors shaped as a 7B model's decode-attention launches see them: the checks read only metadata, so the device
does not matter (the CPU-device check passes under TRITON_INTERPRET=1, set here)."""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from language.kernels.launch_utils import (  # noqa: E402
    check_attention_operands,
    check_device,
    check_out,
    check_shape,
)


def _time_us(fn, repeats: int = 20_000, rounds: int = 5) -> float:
    """Median over rounds of the mean µs per call."""
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        per_round.append((time.perf_counter() - t0) / repeats * 1e6)
    return statistics.median(per_round)


def main() -> None:
    bf16 = torch.bfloat16
    q, out = torch.empty(32, 28, 128, dtype=bf16), torch.empty(32, 28, 128, dtype=bf16)  # [B, Hq, D]
    k, v = torch.empty(1000, 4, 128, dtype=bf16), torch.empty(1000, 4, 128, dtype=bf16)  # [S, Hk, D]
    req_to_token = torch.zeros(64, 4096, dtype=torch.int32)  # [R, L]
    req_idx, seq_lens = torch.zeros(32, dtype=torch.int32), torch.zeros(32, dtype=torch.int32)  # [B]
    x = torch.empty(96, 3584, dtype=bf16)  # [N, H]

    def six_tensor_device():
        check_device(q=q, k_cache=k, v_cache=v, req_to_token=req_to_token, b_req_idx=req_idx, b_seq_len=seq_lens)

    cases = {
        "check_shape, 2 dims, one None": lambda: check_shape("x", x, (None, 3584)),
        "check_device, 6 tensors": six_tensor_device,
        "check_attention_operands": lambda: check_attention_operands(q, k, v, req_to_token),
        "check_out": lambda: check_out(out, (32, 28, 128), bf16, torch.device("cpu")),
    }
    print("| check | µs per call |\n|---|---|")
    for name, fn in cases.items():
        fn()
        print(f"| {name} | {_time_us(fn):.2f} |", flush=True)


if __name__ == "__main__":
    main()
