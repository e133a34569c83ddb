"""Tokenizer loading: Qwen-VL (v1) folders carry a tiktoken vocabulary and remote code, which we replace with our
own offline loader; every other model goes through transformers' AutoTokenizer."""

from __future__ import annotations

import os

from mmserve.prep.tokenizers.qwen_tiktoken import VOCAB_FILE, QwenTiktokenTokenizer


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    if os.path.isfile(os.path.join(model_dir, VOCAB_FILE)):
        return QwenTiktokenTokenizer.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


__all__ = ["QwenTiktokenTokenizer", "load_tokenizer"]
