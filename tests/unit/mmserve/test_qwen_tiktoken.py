"""Qwen-VL's tiktoken tokenizer: special-token ids as the published tokenization_qwen.py numbers them, encode/decode
round trips, the HF-like surface the server uses, and load_tokenizer's choice of loader."""

from __future__ import annotations

import base64
import json
import os

import pytest
import tiktoken

from mmserve.prep.tokenizers import QwenTiktokenTokenizer, load_tokenizer
from mmserve.prep.tokenizers.qwen_tiktoken import PAT_STR, SPECIAL_TOKENS, read_ranks
from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl_tokenizer
from mmserve.testing.checkpoints.qwen_vl import build_qwen_tiktoken

TEXT = "Which two cities are shown in these pictures? 北京 and 重庆, café 🙂\n\n  tabs\tand 12345"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("qwen_tok"))
    build_qwen_tiktoken(out, 400)
    return out


def test_published_special_ids(tmp_path) -> None:
    """With the published 151643 mergeable ranks the specials land at their published ids."""
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    lines += [f"{base64.b64encode(b'tok%d' % i).decode()} {256 + i}" for i in range(151643 - 256)]
    (tmp_path / "qwen.tiktoken").write_text("\n".join(lines) + "\n")
    tok = QwenTiktokenTokenizer.from_pretrained(str(tmp_path))
    expected = {
        "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|extra_0|>": 151646,
        "<|extra_204|>": 151850, "<ref>": 151851, "</ref>": 151852, "<box>": 151853, "</box>": 151854,
        "<quad>": 151855, "</quad>": 151856, "<img>": 151857, "</img>": 151858, "<imgpad>": 151859,
    }  # fmt: skip
    assert {t: tok.special_tokens[t] for t in expected} == expected
    assert (tok.eos_token_id, tok.img_start_id, tok.img_end_id, tok.img_pad_id) == (151643, 151857, 151858, 151859)
    assert len(tok) == 151860


def test_encode_decode(tiny_dir: str) -> None:
    tok = load_tokenizer(tiny_dir)
    assert isinstance(tok, QwenTiktokenTokenizer)
    ranks = read_ranks(os.path.join(tiny_dir, "qwen.tiktoken"))
    n = len(ranks)
    assert len(tok) == n + len(SPECIAL_TOKENS)
    plain = tiktoken.Encoding("check", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})
    ids = tok.encode(TEXT)
    assert ids == plain.encode(TEXT)  # ordinary text: the BPE alone
    assert len(ids) < len(TEXT.encode())  # merges apply
    assert tok.decode(ids) == TEXT

    chat = f"<|im_start|>user\n<img></img>\n{TEXT}<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(chat, add_special_tokens=False)
    assert ids[0] == tok.im_start_id == n + 1 and tok.im_end_id in ids
    assert [tok.img_start_id, tok.img_end_id] == ids[ids.index(tok.img_start_id) : ids.index(tok.img_start_id) + 2]
    assert tok.decode(ids) == chat
    assert tok.decode(ids, skip_special_tokens=True) == f"user\n\n{TEXT}\nassistant\n"
    assert tok.all_special_ids == list(range(n, n + len(SPECIAL_TOKENS)))


def test_token_conversions(tiny_dir: str) -> None:
    tok = load_tokenizer(tiny_dir)
    ids = tok.encode("hello <|im_end|>")
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens[-1] == "<|im_end|>" and all(isinstance(t, bytes) for t in tokens[:-1])
    assert tok.convert_tokens_to_ids(tokens) == ids
    assert tok.convert_tokens_to_string(tokens) == "hello <|im_end|>"
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|endoftext|>"


def test_load_tokenizer_uses_auto_tokenizer_otherwise(tmp_path) -> None:
    build_qwen2_vl_tokenizer(str(tmp_path), base_id=512)
    tok = load_tokenizer(str(tmp_path))
    assert not isinstance(tok, QwenTiktokenTokenizer)
    assert tok.convert_tokens_to_ids("<|image_pad|>") == 524 and tok.eos_token == "<|im_end|>"


def test_chat_template_from_tokenizer_config_and_rendered_by_transformers(tiny_dir: str, tmp_path) -> None:
    """As an HF tokenizer: tokenizer_config.json's chat_template is the tokenizer's own, and apply_chat_template
    renders it (or the one passed) with transformers' renderer, raise_exception included."""
    assert load_tokenizer(tiny_dir).chat_template is None  # the published Qwen-VL-Chat carries none
    for name in os.listdir(tiny_dir):
        os.symlink(os.path.join(tiny_dir, name), tmp_path / name)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{{ eos_token }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.chat_template == template
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == "<user>Hi<|endoftext|>"
    assert tok.apply_chat_template(messages, tokenize=True) == tok.encode("<user>Hi<|endoftext|>")
    with pytest.raises(Exception, match="no user"):
        tok.apply_chat_template(messages, chat_template="{{ raise_exception('no user') }}")
