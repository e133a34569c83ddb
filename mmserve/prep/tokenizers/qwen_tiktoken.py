"""Qwen-VL (v1)'s tokenizer, loaded offline: tiktoken BPE over `qwen.tiktoken` plus Qwen's special tokens, numbered
right after the mergeable ranks as the published `tokenization_qwen.py` numbers them (151643 `<|endoftext|>` on).

It offers the part of the HF tokenizer interface the server uses (encode / decode / special ids / len, and
apply_chat_template through transformers' own Jinja renderer). Special tokens written in the text are always
recognised (Qwen's default: `allowed_special="all"`).
"""

from __future__ import annotations

import base64
import json
import os
import unicodedata
from collections.abc import Iterable

import tiktoken

VOCAB_FILE = "qwen.tiktoken"
PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
IMG_START, IMG_END, IMG_PAD = "<img>", "</img>", "<imgpad>"
EXTRAS = tuple(f"<|extra_{i}|>" for i in range(205))
IMAGE_SPECIALS = ("<ref>", "</ref>", "<box>", "</box>", "<quad>", "</quad>", IMG_START, IMG_END, IMG_PAD)
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END) + EXTRAS + IMAGE_SPECIALS


def read_ranks(path: str) -> dict[bytes, int]:
    """`base64-token rank` per line. (Not tiktoken.load.load_tiktoken_bpe: it caches files by path in a temp dir,
    so a rebuilt file at the same path would be read stale.)"""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f.read().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def write_ranks(path: str, ranks: dict[bytes, int]) -> None:
    with open(path, "w", encoding="utf8") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode('utf8')} {rank}\n")


class QwenTiktokenTokenizer:
    def __init__(self, vocab_file: str, errors: str = "replace") -> None:
        self.errors = errors
        self.mergeable_ranks = read_ranks(vocab_file)
        self.special_tokens = {tok: len(self.mergeable_ranks) + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self.encoding = tiktoken.Encoding(
            "Qwen", pat_str=PAT_STR, mergeable_ranks=self.mergeable_ranks, special_tokens=self.special_tokens
        )
        self._decoder: dict[int, bytes | str] = {rank: tok for tok, rank in self.mergeable_ranks.items()}
        self._decoder.update({i: tok for tok, i in self.special_tokens.items()})
        self.eod_id = self.special_tokens[ENDOFTEXT]
        self.im_start_id, self.im_end_id = self.special_tokens[IM_START], self.special_tokens[IM_END]
        self.img_start_id, self.img_end_id = self.special_tokens[IMG_START], self.special_tokens[IMG_END]
        self.img_pad_id = self.special_tokens[IMG_PAD]

    chat_template: str | None = None  # tokenizer_config.json's, as HF tokenizers load it (the published one has none)

    @classmethod
    def from_pretrained(cls, model_dir: str, **_: object) -> QwenTiktokenTokenizer:
        tokenizer = cls(os.path.join(model_dir, VOCAB_FILE))
        tokenizer.chat_template = _config_chat_template(model_dir)
        return tokenizer

    def apply_chat_template(
        self, conversation: list[dict], chat_template: str | None = None, tokenize: bool = False,
        add_generation_prompt: bool = False, **kwargs: object,
    ) -> str | list[int]:  # fmt: skip
        """transformers' apply_chat_template for this non-HF tokenizer: the same renderer (render_jinja_template,
        sandboxed Jinja with raise_exception and tojson), the special tokens visible to the template as HF passes
        them, kwargs overriding them."""
        from transformers.utils.chat_template_utils import render_jinja_template

        template = chat_template or self.chat_template
        if not template:
            raise ValueError("no chat template: pass chat_template")
        specials = {"eos_token": self.eos_token, "pad_token": self.pad_token}
        rendered, _ = render_jinja_template(
            conversations=[conversation], chat_template=template, add_generation_prompt=add_generation_prompt,
            **{**specials, **kwargs},
        )  # fmt: skip
        return self.encode(rendered[0]) if tokenize else rendered[0]

    # --- the HF-like surface -------------------------------------------------------------------------------------
    eos_token = ENDOFTEXT
    pad_token = ENDOFTEXT
    bos_token = None
    bos_token_id = None

    @property
    def eos_token_id(self) -> int:
        return self.eod_id

    @property
    def pad_token_id(self) -> int:
        return self.eod_id

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.special_tokens.values())

    @property
    def all_special_tokens(self) -> list[str]:
        return list(self.special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def __len__(self) -> int:
        return self.encoding.n_vocab

    def get_vocab(self) -> dict[bytes | str, int]:
        """As Qwen's own tokenizer: the byte tokens and the special tokens."""
        return {**self.mergeable_ranks, **self.special_tokens}

    def encode(self, text: str, add_special_tokens: bool = True, **_: object) -> list[int]:
        """No BOS is ever added (Qwen has none); add_special_tokens is accepted for HF compatibility."""
        return self.encoding.encode(unicodedata.normalize("NFC", text), allowed_special="all", disallowed_special=())

    def __call__(self, text: str, **kwargs: object) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, **kwargs)}

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False, **_: object) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i < self.eod_id]  # every special id comes after the mergeable ranks
        return self.encoding.decode(ids, errors=self.errors)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> bytes | str | list[bytes | str]:
        """Byte tokens come back as bytes, special tokens as str (as in the published tokenizer)."""
        if isinstance(ids, int):
            return self._decoder[ids]
        return [self._decoder[int(i)] for i in ids]

    def convert_tokens_to_ids(self, tokens: bytes | str | Iterable[bytes | str]) -> int | list[int] | None:
        if isinstance(tokens, (bytes, str)):
            return self._token_to_id(tokens)
        return [self._token_to_id(t) for t in tokens]

    def _token_to_id(self, token: bytes | str) -> int | None:
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self.mergeable_ranks.get(token if isinstance(token, bytes) else token.encode("utf8"))

    def convert_tokens_to_string(self, tokens: Iterable[bytes | str]) -> str:
        raw = b"".join(t if isinstance(t, bytes) else t.encode("utf8") for t in tokens)
        return raw.decode("utf8", errors=self.errors)


def _config_chat_template(model_dir: str) -> str | None:
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError):
        return None
    return template if isinstance(template, str) and template else None
