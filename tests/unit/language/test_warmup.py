"""The start-up warm-up covers Triton's specialisation classes and leaves the KV cache and the prefix cache as it
found them."""

from language.warmup import _kind, warmup, warmup_shapes
from mmserve.llm import LLM


def test_shapes_cover_each_reachable_class():
    classes = {(_kind(sum(s)), _kind(max(s)), _kind(len(s))) for s in warmup_shapes()}
    assert len(classes) == len(warmup_shapes()) >= 12
    assert {(1, 1, 1), (16, 16, 1), (0, 0, 1), (16, 1, 16), (0, 0, 0)} <= classes


def test_warmup_frees_everything(tmp_path):
    from mmserve.testing.checkpoints.llama import build_llama

    llm = LLM(build_llama(str(tmp_path / "m")), max_total_token_num=1024, device="cpu")
    engine = llm.engine
    assert engine.prefix is not None  # the prefix cache is on by default
    warmup(engine)
    stats = engine.stats()
    assert stats.kv_used == 0 and engine.kv.num_free_rows() == engine.cfg.running_max_req_size
    assert not engine.has_unfinished() and engine.counters.steps == 0
    # Nothing of its made-up prompts stays cached: the server starts with an empty prefix cache (its metrics say
    # so, and every slot is free).
    assert stats.prefix_cache_tokens == 0 and stats.prefix_cache_hit_tokens == 0
    assert engine.kv.slots.num_free == engine.kv.slots.num_slots
