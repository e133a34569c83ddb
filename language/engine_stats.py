"""The engine's occupancy after a step. Its own module, light to import: the router sends it to the HTTP process
(for /metrics), which must not import the engine to unpickle it."""

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
