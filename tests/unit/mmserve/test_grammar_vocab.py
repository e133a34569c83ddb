"""xgrammar's view of our tokenizers: Qwen-VL (first generation) carries a tiktoken vocabulary that xgrammar cannot
read from a transformers tokenizer; `tiktoken_info` gives each id its raw bytes and keeps the special tokens out of
every grammar's text, and structured output runs on it."""

from __future__ import annotations

import re

import pytest

from language.sampling_params import SamplingParams, StructuredOutput
from mmserve.llm import LLM
from mmserve.prep.tokenizers import load_tokenizer
from mmserve.prep.tokenizers.grammar_vocab import tiktoken_info
from mmserve.testing.checkpoints.qwen_vl import build_qwen_vl


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_qwen_vl(str(tmp_path_factory.mktemp("qwen_vl_grammar")), num_shards=1)


def test_tiktoken_vocabulary(model_dir):
    tokenizer = load_tokenizer(model_dir)
    vocab_size = len(tokenizer.mergeable_ranks) + len(tokenizer.special_tokens) + 7  # the model pads its head
    info = tiktoken_info(tokenizer, vocab_size, [tokenizer.eod_id])
    assert info.vocab_size == vocab_size and info.stop_token_ids == [tokenizer.eod_id]
    for token, rank in list(tokenizer.mergeable_ranks.items())[::37]:
        assert info.decoded_vocab[rank] == token
    specials = set(tokenizer.special_tokens.values()) | set(range(vocab_size - 7, vocab_size))
    assert specials - {tokenizer.eod_id} <= set(info.special_token_ids)


def test_structured_output_on_qwen_vl(model_dir):
    llm = LLM(model_dir, max_total_token_num=512, device="cpu")
    pattern = r"[a-z]{3,6} \d{2}"
    for params in (dict(), dict(do_sample=True)):
        sp = SamplingParams(max_new_tokens=40, structured=StructuredOutput("regex", pattern), **params)
        gen = llm.generate([llm.tokenizer.encode("hello there")], sp)[0]
        assert gen.finish_reason == "stop"
        assert gen.token_ids[-1] == llm.tokenizer.eod_id
        assert re.fullmatch(pattern, llm.tokenizer.decode(gen.token_ids[:-1]))
