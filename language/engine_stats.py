"""The engine's occupancy after a step, and its cumulative work (StepCounters, for throughput logs). Its own module,
light to import: the router sends EngineStats to the HTTP process (for /metrics), which must not import the engine
to unpickle it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_used: int  # slots running requests hold (their own and the cached prefixes they use)
    kv_total: int
    prefix_cache_tokens: int = 0  # slots the prefix cache holds (evictable or in use)
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache, since start
    # the slots the running requests would hold at their peak (prompt + max_new_tokens each, shared prefixes counted
    # once per request): LightLLM's naive load estimate, for /token_load
    peak_tokens: int = 0


@dataclass
class StepCounters:
    """Cumulative work of the engine, for throughput logs."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    busy_s: float = 0.0  # wall time inside step() that ran a batch
    tower_waits: int = 0  # decode-only steps held back while the vision tower ran (the router's tower turn)

    def summary(self, since: StepCounters, elapsed_s: float) -> str:
        """Throughput since an earlier snapshot. `busy` is host time inside step(), which with the overlapped
        loop includes waiting for the device."""
        steps = self.steps - since.steps
        busy = self.busy_s - since.busy_s
        return (
            f"{steps} steps ({busy / max(steps, 1) * 1e3:.1f} ms each), "
            f"prefill {(self.prefill_tokens - since.prefill_tokens) / elapsed_s:.0f} tok/s, "
            f"decode {(self.decode_tokens - since.decode_tokens) / elapsed_s:.0f} tok/s, busy {busy / elapsed_s:.0%}"
            + (f", {self.tower_waits - since.tower_waits} steps held for the tower" if self.tower_waits else "")
        )
