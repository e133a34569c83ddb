"""The kernel table the benchmarks print after a torch profiler run: device time per call of the profiled work, each
kernel's share and launches per call, the most costly first."""

from __future__ import annotations


def print_kernel_table(prof, calls: int, top: int, what: str) -> None:
    """prof: a finished `torch.profiler.profile` over `calls` repetitions of one piece of work, named by `what`
    (e.g. "per encode")."""
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in kernels)
    print(f"GPU {total / calls / 1e3:.2f} ms {what}")
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:top]:
        share = e.device_time_total / total
        print(f"  {e.device_time_total / calls / 1e3:7.2f} ms {share:6.1%}  x{e.count / calls:5.1f}  {e.key[:100]}")
