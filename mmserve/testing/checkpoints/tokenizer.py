"""A small byte-level BPE tokenizer trained locally, saved so that `AutoTokenizer.from_pretrained` loads it."""

from __future__ import annotations

import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# Enough varied text (with multi-byte characters) that the merges produce real multi-character tokens.
_CORPUS = [
    "A chat between a curious human and an artificial intelligence assistant.",
    "The assistant gives helpful, detailed, and polite answers to the human's questions.",
    "USER: What is shown in this picture? ASSISTANT: The picture shows a city by a river at night.",
    "What is AI? Artificial intelligence is the study of machines that learn, reason and act.",
    "Describe the image in detail. There is a cat sitting on a red chair next to the window.",
    "Which two cities are shown in these pictures? Compare them. Chongqing and Beijing are large cities.",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; :",
    "Café, naïve, façade, über, smörgåsbord, jalapeño. 北京 重庆 上海 你好 世界 こんにちは 안녕하세요 🙂🚀",
    "def hello(name):\n    return f'Hello, {name}!'\n",
]


def build_tokenizer(
    out_dir: str,
    vocab_size: int = 512,
    extra_special_tokens: dict[int, str] | None = None,
    added_tokens: dict[int, str] | None = None,
    bos_token: str = "<s>",
    eos_token: str = "</s>",
    add_bos: bool = True,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of `vocab_size` ids (specials `<unk>`, bos, eos at 0, 1, 2), then add
    `extra_special_tokens` and the ordinary `added_tokens` (kept in decoded text) at exactly the ids given (the gap up
    to each id is filled with reserved tokens), and save `tokenizer.json` + `tokenizer_config.json` into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", bos_token, eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    wanted = [(i, t, True) for i, t in (extra_special_tokens or {}).items()]
    wanted += [(i, t, False) for i, t in (added_tokens or {}).items()]
    for token_id, content, special in sorted(wanted):
        size = tok.get_vocab_size()
        if size < token_id:
            # Fillers are ordinary (non-special) tokens, so text from a random-weight model that lands on them still
            # decodes to visible text, as a real vocabulary would. One call: one by one is quadratic in `tokenizers`.
            tok.add_tokens([AddedToken(f"<|reserved_{i}|>", normalized=False) for i in range(size, token_id)])
        if tok.get_vocab_size() != token_id:
            raise ValueError(
                f"special token {content!r} wants id {token_id}, but ids up to {tok.get_vocab_size()} are used"
            )
        if special:
            tok.add_special_tokens([content])
        else:
            tok.add_tokens([AddedToken(content, normalized=False)])
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, 1)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos_token, eos_token=eos_token, unk_token="<unk>", chat_template=chat_template
    )
    fast.save_pretrained(out_dir)
    return fast
