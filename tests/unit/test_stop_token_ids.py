"""A stop sequence that is exactly one special token is matched on its id (RequestPreparer): looked up in the
tokenizer pool before the prompt's images are prepared, and with no stop sequences not at all."""

from __future__ import annotations

import asyncio

import pytest

from language.sampling_params import SamplingParams
from mmserve.checkpoints.tokenizer import build_tokenizer
from mmserve.messages import ImageRef
from mmserve.protocol import GenerateInput
from mmserve.tokenization import Limits, PreparedPrompt, RequestPreparer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))  # "</s>" is the special id 2


class Images:
    """The image side of a request, recording when it was asked (what the real one awaits: the tower)."""

    def __init__(self, calls: list[str]):
        self.calls = calls

    async def prepare(self, rid, prompt, multimodal_params, run_sync, defer=False) -> PreparedPrompt:
        self.calls.append("images")
        return PreparedPrompt([1, 5, 0, 0, 6], (ImageRef("key", 2, 2),))

    def release(self, rid: str) -> None:
        pass


def _prepare(tokenizer, calls: list[str], **params):
    async def run_sync(fn, *args):
        calls.append(fn.__name__)
        return fn(*args)

    preparer = RequestPreparer(tokenizer, Limits(1024), Images(calls))
    req = GenerateInput("a <image> b", SamplingParams(max_new_tokens=2, **params))
    return asyncio.run(preparer.prepare("r", req, run_sync))


def test_a_special_token_stop_becomes_a_stop_id_before_the_images_are_prepared(tokenizer):
    calls: list[str] = []
    out = _prepare(tokenizer, calls, stop_sequences=("</s>", "hello"))
    assert out.params.stop_token_ids == (2,)  # "hello" stays a text stop sequence
    assert calls == ["_with_stop_token_ids", "images"]


def test_without_stop_sequences_there_is_no_lookup(tokenizer):
    calls: list[str] = []
    out = _prepare(tokenizer, calls)
    assert out.params.stop_token_ids == () and calls == ["images"]
