"""Per-request decoding options in the detokenizer: skip_special_tokens, print_eos_token and
add_spaces_between_special_tokens, carried from SamplingParams through DetokSetup."""

from __future__ import annotations

import pytest

from language.request import RequestOutput
from language.sampling_params import SamplingParams
from mmserve.detok.detokenizer import Detokenizer
from mmserve.ipc.messages import DetokSetup, RouterBatch, TokenizedRequest
from mmserve.testing.checkpoints.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


def run(tokenizer, ids: list[int], reason: str, **params) -> tuple[str, list[str]]:
    """Feed ids one step at a time, the last finishing with `reason`; -> (joined text, per-token texts)."""
    setup = DetokSetup.of(TokenizedRequest("r", [1, 2, 3], SamplingParams(**params)))
    detok = Detokenizer(tokenizer)
    detok.handle(RouterBatch(setups=[setup]))
    texts, tokens = [], []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        out = RequestOutput("r", [t], [-0.5], last, reason if last else None, 3, i + 1)
        batch, _ = detok.handle(RouterBatch(outputs=[out]))
        texts += [o.text for o in batch.outputs]
        tokens += [d.text for o in batch.outputs for d in o.tokens]
    assert batch.outputs[-1].finished and detok.num_requests == 0
    return "".join(texts), tokens


def test_setup_carries_the_options():
    p = SamplingParams(skip_special_tokens=False, add_spaces_between_special_tokens=False, print_eos_token=True)
    s = DetokSetup.of(TokenizedRequest("r", [1, 2], p))
    assert (s.skip_special_tokens, s.spaces_between_special_tokens, s.print_eos_token) == (False, False, True)
    assert s.prompt_tokens == 2 and s.stop_sequences == ()


def test_skip_special_tokens_false_keeps_them_in_the_text(tokenizer):
    body = tokenizer.encode("hello world", add_special_tokens=False)
    ids = body + [tokenizer.bos_token_id] + body
    assert run(tokenizer, ids, "length")[0] == "hello worldhello world"
    text, pieces = run(tokenizer, ids, "length", skip_special_tokens=False)
    assert text == "hello world<s>hello world" == tokenizer.decode(ids, skip_special_tokens=False)
    assert "".join(pieces) == text


def test_print_eos_token_shows_the_eos_that_ended_generation(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("hello world", add_special_tokens=False) + [eos]
    assert run(tokenizer, ids, "stop")[0] == "hello world"
    assert run(tokenizer, ids, "stop", print_eos_token=True)[0] == "hello world</s>"
    # without print_eos_token the stopping EOS stays out even when special tokens are kept
    assert run(tokenizer, ids, "stop", skip_special_tokens=False)[0] == "hello world"
    text, pieces = run(tokenizer, ids, "stop", skip_special_tokens=False, print_eos_token=True)
    assert text == "hello world</s>" and pieces[-1] == "</s>"
    # an EOS that did not end generation (ignore_eos) is an ordinary special token
    assert run(tokenizer, ids + ids[:1], "length", skip_special_tokens=False)[0].count("</s>") == 1


def test_incomplete_character_before_eos_is_flushed_once(tokenizer):
    ids = tokenizer.encode("北京🙂", add_special_tokens=False)
    text, pieces = run(tokenizer, ids[:-1] + [tokenizer.eos_token_id], "stop", print_eos_token=True)
    expected = tokenizer.decode(ids[:-1], skip_special_tokens=True) + "</s>"
    assert text == expected == "".join(pieces)


def test_spaces_between_special_tokens_is_passed_when_the_tokenizer_takes_it():
    class SlowLike:
        all_special_ids = [0]
        seen: list[dict] = []

        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False, **kw):
            self.seen.append(kw)
            return "".join("x" for _ in ids)

    tok = SlowLike()
    run(tok, [5, 6], "length", add_spaces_between_special_tokens=False, skip_special_tokens=False)
    assert {"spaces_between_special_tokens": False} in tok.seen

    class Strict(SlowLike):
        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
            return "".join("x" for _ in ids)

    assert run(Strict(), [5, 6], "length", add_spaces_between_special_tokens=False)[0] == "xx"
