"""The incremental detokenizer equals decode(all ids); stop sequences cut the text and abort the request."""

from __future__ import annotations

import random

import pytest

from language.engine_stats import EngineStats
from language.request import RequestOutput
from mmserve.detok.detokenizer import _MAX_HELD, DECODE_KWARGS, Detokenizer, IncrementalDecoder, StopMatcher
from mmserve.ipc.messages import AbortRequest, DetokSetup, RouterBatch, RouterStats
from mmserve.testing.checkpoints.tokenizer import build_tokenizer

MULTIBYTE_TEXTS = [
    "Café naïve façade über smörgåsbord jalapeño",
    "北京 重庆 上海 你好 世界",
    "こんにちは 안녕하세요 🙂🚀 emoji 🙂 mixed with text",
    "The quick brown fox jumps over the lazy dog. 0123456789",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


def incremental(tokenizer, ids: list[int]) -> tuple[str, list[str]]:
    dec = IncrementalDecoder(tokenizer)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    return "".join(pieces), pieces


def test_random_ids_match_full_decode(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        text, pieces = incremental(tokenizer, ids)
        assert text == tokenizer.decode(ids, **DECODE_KWARGS), ids
        # only the final flush may end in a half character (as decode(all) shows it)
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])


def test_bytes_that_never_form_a_character_are_released_with_a_bounded_window(tokenizer):
    """A model held on byte tokens that never make a character (logit_bias can force one): past _MAX_HELD pending
    tokens their replacement characters go out as they decode, so a push never decodes more than ~2 x _MAX_HELD
    tokens (before, the window and each push's work grew with every token); the whole is still decode(all)."""
    garbage = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd")
    ids = [garbage] * (5 * _MAX_HELD) + tokenizer.encode("ok", add_special_tokens=False)
    dec = IncrementalDecoder(tokenizer)
    pieces = []
    for i in ids:
        pieces.append(dec.push(i))
        assert len(dec.ids) - dec._prefix_offset <= 2 * _MAX_HELD + 1
    pieces.append(dec.flush())
    assert "".join(pieces) == tokenizer.decode(ids, **DECODE_KWARGS)
    assert sum(1 for p in pieces[: 5 * _MAX_HELD] if p) >= 2  # released along the way, not only at the end


def test_multibyte_text_round_trips(tokenizer):
    rng = random.Random(1)
    for text in MULTIBYTE_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert incremental(tokenizer, ids)[0] == text
        # random slices start and end inside characters: still exactly decode(slice)
        for _ in range(30):
            a = rng.randrange(len(ids))
            b = rng.randint(a + 1, len(ids))
            assert incremental(tokenizer, ids[a:b])[0] == tokenizer.decode(ids[a:b], **DECODE_KWARGS)


def test_pieces_hold_back_incomplete_characters(tokenizer):
    ids = tokenizer.encode("🙂🚀", add_special_tokens=False)
    _, pieces = incremental(tokenizer, ids)
    assert len(ids) > 2  # the two 4-byte characters span several byte-level tokens
    assert "".join(pieces) == "🙂🚀"
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens completed no character yet


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Hello world")  # starts with BOS
    ids = ids + [tokenizer.eos_token_id]
    assert ids[0] == tokenizer.bos_token_id
    assert incremental(tokenizer, ids)[0] == "Hello world"


def test_stop_matcher_cuts_and_holds_back():
    m = StopMatcher(("STOP", "\n\n"))
    assert m.add("abc S") == "abc "  # "S" may start "STOP": held back
    assert m.add("T") == ""
    assert m.add("x") == "STx"  # it did not
    assert m.add("yy ST") == "yy "
    assert m.add("OP and more") == ""
    assert m.stopped and m.text == "abc STxyy "
    assert m.finish() == ""


def test_stop_matcher_earliest_stop_wins():
    m = StopMatcher(("world", "lo"))
    assert m.add("hello world") == "hel"
    assert m.stopped


def test_stop_matcher_can_keep_the_stop_string():
    """vLLM's include_stop_str_in_output: the text ends with the stop string, found across pieces, and nothing is
    held back meanwhile; where two start at once the longer is the one kept."""
    m = StopMatcher(("STOP", "ST"), include=True)
    assert m.add("abc S") == "abc S"
    assert m.add("xx STO") == "xx ST"
    assert m.stopped and m.text == "abc Sxx ST"
    m = StopMatcher(("ST", "STOP"), include=True)
    assert m.add("abc S") + m.add("TOP and more") == "abc STOP"


def test_stop_matcher_without_stops_releases_everything():
    m = StopMatcher(())
    assert m.add("abc") == "abc"
    assert m.finish() == ""


def _out(rid, ids, finished=False, reason=None, n=0):
    return RequestOutput(rid, ids, [-1.0] * len(ids), finished, reason, 3, n)


def test_detokenizer_stop_sequence_aborts_and_drops_late_tokens(tokenizer):
    detok = Detokenizer(tokenizer)
    text = "Hello world. The quick brown fox"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stats = RouterStats(EngineStats(1, 0, 10, 100))
    batch, aborts = detok.handle(RouterBatch([DetokSetup("r1", ("quick",), 3)], [_out("r1", ids[:2])], stats))
    assert batch.stats == stats and not aborts
    collected = [o.text for o in batch.outputs]
    finished = None
    for i in range(2, len(ids)):
        batch, aborts = detok.handle(RouterBatch(outputs=[_out("r1", [ids[i]])]))
        if batch.outputs:
            collected += [o.text for o in batch.outputs]
            if batch.outputs[-1].finished:
                finished = batch.outputs[-1]
                assert aborts == [AbortRequest("r1")]
                break
    assert finished is not None and finished.finish_reason == "stop"
    assert "".join(collected) == "Hello world. The "
    # the router's tokens that were already on their way, and its abort output, are dropped
    batch, aborts = detok.handle(RouterBatch(outputs=[_out("r1", [ids[-1]]), _out("r1", [], True, "abort")]))
    assert batch.outputs == [] and aborts == []
    assert detok.num_requests == 0


def test_the_last_output_names_what_stopped_it(tokenizer):
    """vLLM's stop_reason: the stop string the text ended at, the stop_token_ids id the engine stopped on, or None
    (EOS, the length)."""
    ids = tokenizer.encode("Hello world. The quick brown fox", add_special_tokens=False)

    def last_output(setup: DetokSetup, outputs) -> object:
        detok = Detokenizer(tokenizer)
        batch, _ = detok.handle(RouterBatch([setup], outputs))
        return batch.outputs[-1]

    by_string = last_output(DetokSetup("a", ("quick",), 3), [_out("a", ids)])
    assert by_string.finished and by_string.stop_reason == "quick"
    by_id = last_output(DetokSetup("b", (), 3, stop_token_ids=(ids[3],)), [_out("b", ids[:4], True, "stop")])
    assert by_id.stop_reason == ids[3]
    by_eos = last_output(DetokSetup("c", (), 3, stop_token_ids=(ids[0],)), [_out("c", ids[:4], True, "stop")])
    assert by_eos.stop_reason is None  # the engine's stop token was not one of stop_token_ids
    by_length = last_output(DetokSetup("d", (), 3), [_out("d", ids[:4], True, "length")])
    assert by_length.stop_reason is None


def test_detokenizer_finish_flushes_and_counts(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode("北京🙂", add_special_tokens=False)
    detok.handle(RouterBatch(setups=[DetokSetup("r", (), 5)]))
    texts, tokens = [], []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        batch, _ = detok.handle(RouterBatch(outputs=[_out("r", [t], last, "length" if last else None, i + 1)]))
        texts += [o.text for o in batch.outputs]
        tokens += [d for o in batch.outputs for d in o.tokens]
    final = batch.outputs[-1]
    assert final.finished and final.finish_reason == "length" and final.output_tokens == len(ids)
    assert final.prompt_tokens == 5
    assert "".join(texts) == "北京🙂" == "".join(d.text for d in tokens)
    assert [d.id for d in tokens] == ids
