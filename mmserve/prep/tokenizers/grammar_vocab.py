"""The model's tokenizer as xgrammar sees it (a TokenizerInfo: each token id's bytes), for the engine's structured
output. The engine builds it through `grammar_vocabulary` on its first structured request, off its step."""

from __future__ import annotations

import functools

from language.grammar import VocabularyBuilder
from mmserve.prep.tokenizers import load_tokenizer
from mmserve.prep.tokenizers.qwen_tiktoken import QwenTiktokenTokenizer


def grammar_vocabulary(model_dir: str, trust_remote_code: bool = False) -> VocabularyBuilder:
    return functools.partial(_tokenizer_info, model_dir, trust_remote_code)


def _tokenizer_info(model_dir: str, trust_remote_code: bool, vocab_size: int, stop_ids: tuple[int, ...]):
    import xgrammar as xgr

    tokenizer = load_tokenizer(model_dir, trust_remote_code)
    stop = list(stop_ids) or None
    if isinstance(tokenizer, QwenTiktokenTokenizer):
        return tiktoken_info(tokenizer, vocab_size, stop)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)


def tiktoken_info(tokenizer: QwenTiktokenTokenizer, vocab_size: int, stop_ids: list[int] | None):
    """Qwen-VL's tiktoken vocabulary: each id's raw bytes. Special tokens stay empty, which xgrammar reads as never
    part of a grammar's text (only stop ids end one), as they never show in the detokenized text either."""
    import xgrammar as xgr

    encoded = [b""] * vocab_size
    for token, rank in tokenizer.mergeable_ranks.items():
        if rank < vocab_size:
            encoded[rank] = token
    return xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids)
