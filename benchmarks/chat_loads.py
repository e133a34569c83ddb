"""The chat loads of `loads.py` (`turns` > 1): `num` conversations at once; each turn resends the whole history
(earlier questions, images and the server's own answers) plus a new question, and may add an image. Its requests
depend on the answers, so `chat_conversations` plans the turns and `Conversation.request` builds turn k's request
from the answers so far."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.loads import IMAGE_MARK, SYSTEM, Load, RequestSpec, chat_messages, load_index, question, random_png

# the placeholder pieces an answer put back into the history must not contain (see `clean_answer`)
IMAGE_MARKERS = {
    "llava": ("<image>",),
    "qwen2_vl": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "qwen2_5_vl": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "qwen3_vl": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "internvl": ("<img>", "<IMG_CONTEXT>", "</img>"),
}


@dataclass(frozen=True)
class ChatTurn:
    question: str
    image_png: bytes | None  # the image this turn adds, or None


def chat_prompt(family: str, turns: list[ChatTurn], answers: list[str]) -> str:
    """The whole conversation in the family's chat format, as `build_prompt` formats one turn: every turn's user
    message (its image's mark first), the answers given so far after theirs, and the open assistant turn of the last
    (`len(answers) == len(turns) - 1`)."""
    if len(answers) != len(turns) - 1:
        raise ValueError(f"{len(turns)} turns need {len(turns) - 1} answers, got {len(answers)}")
    mark = IMAGE_MARK[family]
    parts = []
    if family == "llava":  # LLaVA-1.5 (vicuna_v1): "USER: q ASSISTANT: a</s>USER: ..."
        for k, turn in enumerate(turns):
            parts.append(f"USER: {mark if turn.image_png is not None else ''}{turn.question} ASSISTANT:")
            if k < len(answers):
                parts.append(f" {answers[k]}</s>")
        return "".join(parts)
    parts.append(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
    for k, turn in enumerate(turns):
        image = mark if turn.image_png is not None else ""
        parts.append(f"<|im_start|>user\n{image}{turn.question}<|im_end|>\n<|im_start|>assistant\n")
        if k < len(answers):
            parts.append(f"{answers[k]}<|im_end|>\n")
    return "".join(parts)


def clean_answer(family: str, text: str) -> str:
    """An answer as it goes back into the history: the server's text, less any image placeholder (a random model's
    text could spell one, and the server would then expect one image more than the request has)."""
    for marker in IMAGE_MARKERS[family]:
        text = text.replace(marker, "")
    return text


@dataclass(frozen=True)
class Conversation:
    family: str
    turns: tuple[ChatTurn, ...]  # planned up front: questions and images are fixed, the answers come from the server

    def request(self, answers: list[str]) -> RequestSpec:
        """Turn `len(answers) + 1`: the history so far with `answers` (the server's texts) and the next question; the
        images of every turn up to it, in order."""
        k = len(answers)
        if k >= len(self.turns):
            raise ValueError(f"the conversation has {len(self.turns)} turns; {k} answers leave none to ask")
        turns = list(self.turns[: k + 1])
        cleaned = [clean_answer(self.family, a) for a in answers]
        prompt = chat_prompt(self.family, turns, cleaned)
        images = [t.image_png for t in turns if t.image_png is not None]
        messages = chat_messages(self.family, [(t.question, t.image_png) for t in turns], cleaned)
        return RequestSpec(prompt, images[0] if images else None, tuple(images[1:]), messages=messages)


def chat_conversations(load: Load, family: str, n_words: int = 64) -> list[Conversation]:
    """`load.num` conversations of `load.turns` turns. Conversation c's first question is question c of the other
    loads; every image is its own (seeds unique per load, conversation and turn)."""
    if not load.is_chat:
        raise ValueError(f"{load.name} is not a chat load")
    base = load_index(load) * 100_000
    convs = []
    for c in range(load.num):
        turns = []
        for t, size in enumerate(load.turn_images):
            text = question(c if t == 0 else 500_000 + 10 * c + t, n_words)
            turns.append(ChatTurn(text, random_png(base + 10 * c + t, size) if size else None))
        convs.append(Conversation(family, tuple(turns)))
    return convs
