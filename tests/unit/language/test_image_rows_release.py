"""The engine drops a request's image embeddings as soon as the step that ran its prompt's last chunk has been
collected (not before: a chunked prefill reads the image's rows over several steps), while it goes on decoding."""

from __future__ import annotations

import weakref

import pytest
import torch

from language.request import MultimodalItem, Request
from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from mmserve.testing.checkpoints.llama import build_llama


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(build_llama(str(tmp_path_factory.mktemp("llama"))), max_total_token_num=256, device="cpu",
               chunked_prefill_size=8)  # fmt: skip


def test_image_rows_are_dropped_after_the_last_prefill_chunk_ran(llm):
    engine = llm.engine
    hidden = engine.model_info.hidden_size
    embeds = torch.randn(12, hidden)
    gone = weakref.ref(embeds)
    # 24 prompt tokens in chunks of 8: the image (tokens 6..17) is read by the first three chunks.
    req = Request("img", list(range(3, 27)), SamplingParams(max_new_tokens=20, ignore_eos=True),
                  [MultimodalItem(6, embeds, "k" * 32)])  # fmt: skip
    del embeds
    engine.add_request(req)
    steps_until_first_token = 0
    while not req.output_ids:
        assert req.mm_items and gone() is not None  # still to be read, or read by a step not yet collected
        engine.step()
        steps_until_first_token += 1
    assert steps_until_first_token >= 3  # three chunks, and the overlapped collect one step later
    assert req.mm_items == [] and gone() is None  # released: no view on the image's memory is left
    assert not req.finished  # while it still decodes
    while engine.has_unfinished():
        engine.step()
    assert len(req.output_ids) == 20 and engine.stats().kv_used == 0
