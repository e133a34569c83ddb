"""add_special_tokens for the prompt: the tokenizer's default when not given, honoured on text prompts, and on
prompts an image preparer tokenized its own way (the tokenizer's BOS dropped, image offsets moved with it)."""

from __future__ import annotations

import asyncio

import pytest

from language.sampling_params import SamplingParams
from mmserve.http.protocol import BadRequest, GenerateInput
from mmserve.ipc.messages import ImageRef
from mmserve.prep.tokenization import Limits, MultimodalInput, PreparedPrompt, RequestPreparer
from mmserve.testing.checkpoints.tokenizer import build_tokenizer

TEXT = "hello world"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))  # adds <s> (id 1) in front by default


async def _run_sync(fn, *args):
    return fn(*args)


def prepare(preparer, **params):
    req = GenerateInput(TEXT, SamplingParams(max_new_tokens=2, **params))
    return asyncio.run(preparer.prepare("r", req, _run_sync))


def test_text_prompt(tokenizer):
    preparer = RequestPreparer(tokenizer, Limits(1024))
    plain = tokenizer.encode(TEXT, add_special_tokens=False)
    assert prepare(preparer).prompt_ids == [1] + plain
    assert prepare(preparer, add_special_tokens=True).prompt_ids == [1] + plain
    assert prepare(preparer, add_special_tokens=False).prompt_ids == plain


class FakeImages:
    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = prompt_ids
        self.released: list[str] = []

    async def prepare(self, rid: str, request: MultimodalInput, run_sync) -> PreparedPrompt:
        return PreparedPrompt(list(self.prompt_ids), (ImageRef("key", 2, 3),))

    def release(self, rid: str) -> None:
        self.released.append(rid)


def test_image_prompt_drops_the_tokenizers_bos_and_moves_offsets(tokenizer):
    images = FakeImages([1, 5, 0, 0, 0, 6])
    preparer = RequestPreparer(tokenizer, Limits(1024), images)
    kept = prepare(preparer)
    assert kept.prompt_ids == [1, 5, 0, 0, 0, 6] and kept.images[0].offset == 2
    dropped = prepare(preparer, add_special_tokens=False)
    assert dropped.prompt_ids == [5, 0, 0, 0, 6] and dropped.images[0].offset == 1
    images.prompt_ids = [5, 0, 0, 0, 6]  # a family whose prompt has no BOS: nothing to drop
    assert prepare(preparer, add_special_tokens=False).prompt_ids == [5, 0, 0, 0, 6]


def test_a_prompt_of_no_tokens_is_refused_and_released(tokenizer):
    images = FakeImages([1])
    preparer = RequestPreparer(tokenizer, Limits(1024), images)
    with pytest.raises(BadRequest) as e:
        prepare(preparer, add_special_tokens=False)
    assert e.value.field == "inputs" and images.released == ["r"]
