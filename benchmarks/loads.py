"""The serving loads of issue 13, shared by `serve_bench.py` (any server speaking LightLLM's `/generate_stream`) and
`hf_baseline.py` (HF transformers `generate` on the same work): names, request counts, prompts and images.

Everything is deterministic (seeded), so two servers measured in two processes get byte-identical requests. Every
request carries its own random image (no cache hits) unless the load says otherwise; images of different loads never
repeat either, so no load warms the cache for the next.

A chat load (`turns` > 1) has its requests planned in `chat_loads.py`: they depend on the server's answers."""

from __future__ import annotations

import base64
import io
import itertools
import json
import random
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class Load:
    name: str
    num: int  # concurrent requests, or sequential repeats when `sequential`
    size: int | None  # square image side in px; None: text only
    same_image: bool = False  # all requests share one image, sent once before the timed part to warm the cache
    sequential: bool = False  # one request alone, `num` times in a row; medians reported
    # a multi-turn chat: the side in px of the image each turn adds (None: none); `num` conversations at once
    turn_images: tuple[int | None, ...] = ()
    # mixed lengths (seeded per request, bounds included): image width and height in px each (instead of `size`),
    # words in the question (else the run's --question_words), new tokens (else the run's --max_new_tokens)
    size_range: tuple[int, int] | None = None
    word_range: tuple[int, int] | None = None
    new_token_range: tuple[int, int] | None = None
    rate: float | None = None  # Poisson arrivals at this many requests per second (seeded); None: all at once

    @property
    def has_images(self) -> bool:
        return self.size is not None or self.size_range is not None

    @property
    def concurrency(self) -> int:
        return 1 if self.sequential else self.num

    @property
    def turns(self) -> int:
        return max(1, len(self.turn_images))

    @property
    def is_chat(self) -> bool:
        return self.turns > 1

    @property
    def image_sizes(self) -> set[int]:
        """Image sides the load sends (for the warm-up: a mixed-size load's smallest and largest)."""
        return {s for s in (self.size, *self.turn_images, *(self.size_range or ())) if s is not None}

    @property
    def max_images(self) -> int:
        """Images in one request (a chat's last turn carries every turn's)."""
        if self.is_chat:
            return sum(1 for s in self.turn_images if s is not None)
        return int(self.has_images)

    @property
    def mixed(self) -> bool:
        """Requests differ in shape or arrive over time: not a batch HF generate runs alike."""
        return any(r is not None for r in (self.size_range, self.word_range, self.new_token_range, self.rate))


LOADS: dict[str, Load] = {
    load.name: load
    for load in (
        Load("img336_x64", 64, 336),
        Load("img896_x64", 64, 896),
        Load("img896_same_x64", 64, 896, same_image=True),
        Load("one_336", 5, 336, sequential=True),
        Load("one_896", 5, 896, sequential=True),
        Load("img336_x256", 256, 336),
        Load("text_x64", 64, None),
        Load("text_one", 5, None, sequential=True),
        Load("text_x256", 256, None),
        # the prefix-cache issue: 5 turns, an 896 px image in the first and a 336 px one in the third
        Load("chat896_5turn", 4, 896, turn_images=(896, None, 336, None, None)),
        # issue 29's mixed lengths: text only, and images of mixed sizes (each side 224-1344 px)
        Load("text_mixed_x256", 256, None, word_range=(16, 512), new_token_range=(16, 512)),
        Load("img_mixed_x64", 64, None, size_range=(224, 1344), word_range=(16, 512), new_token_range=(16, 512)),
        # issue 29's Poisson arrivals: 12 requests/s over ~21 s, images of mixed sizes, mixed output lengths
        Load("poisson12_x256", 256, None, size_range=(224, 1344), new_token_range=(16, 512), rate=12.0),
    )
}

# Common English words; each is one token for the byte-level BPE that `.lightllm/make_qwen2vl_7b.py` trains, so a
# question of 64 words is 64 tokens there (the 249-token prompt at 336 px: 144 image + 105 text tokens).
WORDS = (
    "the of and to in is was for on that with as by at from it an are which this be or had not but one have they "
    "you all there been has more also when who will would can time first new after two some other into up than only "
    "over most out then made such where about many between these may world through under while later both part three "
    "well known before work early people used year school group house history music water light river north south "
    "east west small large high long great old young black white red green blue town road street market field image "
    "picture photo color shape animal tree flower mountain sea sky cloud stone glass paper book table chair window "
    "door garden bridge train car boat horse dog cat bird fish apple bread tea morning evening night summer winter"
).split()

SYSTEM = "You are a helpful assistant."
QWEN_VL_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
# Qwen2.5-VL and Qwen3-VL prompts are Qwen2-VL's: ChatML, the same vision block per image
IMAGE_MARK = {
    "llava": "<image>\n",
    "qwen2_vl": QWEN_VL_MARK,
    "qwen2_5_vl": QWEN_VL_MARK,
    "qwen3_vl": QWEN_VL_MARK,
    "internvl": "<IMG_CONTEXT>\n",
    "gemma3": "<start_of_image>",
}
FAMILIES = tuple(IMAGE_MARK)


def select_loads(
    names: str | None, num_requests: int | None = None, repeats: int | None = None, counts: str | None = None
) -> list[Load]:
    """`names`: comma-separated load names (None or "all": every load, in the order above; "" or "none": none).
    `num_requests` replaces the count of every concurrent load, `repeats` that of every sequential one, `counts`
    ("name=N,...") one load's."""
    if names is not None and names.strip() in ("", "none"):
        return []
    chosen = list(LOADS) if names in (None, "all") else [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in LOADS]
    if unknown:
        raise ValueError(f"unknown load(s) {unknown}; known: {', '.join(LOADS)}")
    per_load: dict[str, int] = {}
    for item in (counts or "").split(","):
        if item.strip():
            name, _, value = item.partition("=")
            if name.strip() not in LOADS:
                raise ValueError(f"--counts: unknown load {name!r}")
            per_load[name.strip()] = int(value)
    out = []
    for name in chosen:
        load = LOADS[name]
        if load.sequential and repeats is not None:
            load = replace(load, num=repeats)
        elif not load.sequential and num_requests is not None:
            load = replace(load, num=num_requests)
        if name in per_load:
            load = replace(load, num=per_load[name])
        out.append(load)
    return out


def question(seed: int, n_words: int = 64) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def build_prompt(family: str, text: str, with_image: bool) -> str:
    mark = IMAGE_MARK[family] if with_image else ""
    if family == "llava":
        return f"USER: {mark}{text} ASSISTANT:"
    if family == "gemma3":  # its chat template's turns, the system message folded into the user's (less the BOS)
        return f"<start_of_turn>user\n{SYSTEM}\n\n{mark}{text}<end_of_turn>\n<start_of_turn>model\n"
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{mark}{text}<|im_end|>\n<|im_start|>assistant\n"


def random_png(seed: int, size: int, height: int | None = None) -> bytes:
    """Uniform random RGB noise, `size` px wide and `height` (default `size`) high: distinct, incompressible; stored
    (compress_level 0): deflate cannot shrink noise."""
    arr = np.random.default_rng(seed).integers(0, 256, (height or size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="PNG", compress_level=0)
    return buf.getvalue()


@dataclass(frozen=True)
class Message:
    """One chat message as the OpenAI API carries it; a user message's image goes before its text, as the prompt's
    image mark does."""

    role: str  # system, user or assistant
    text: str
    image_png: bytes | None = None

    def openai(self) -> dict:
        if self.image_png is None:
            return {"role": self.role, "content": self.text}
        url = "data:image/png;base64," + base64.b64encode(self.image_png).decode()
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": self.text}]
        return {"role": self.role, "content": parts}


def chat_messages(family: str, turns: list[tuple[str, bytes | None]], answers: list[str]) -> tuple[Message, ...]:
    """The messages whose chat template renders what `build_prompt` / `chat_prompt` write: the system message
    (not for LLaVA, whose prompt has none), then each (question, image) turn and the answer after it, if any."""
    out = [] if family == "llava" else [Message("system", SYSTEM)]
    for k, (text, image) in enumerate(turns):
        out.append(Message("user", text, image))
        if k < len(answers):
            out.append(Message("assistant", answers[k]))
    return tuple(out)


# How the requests sample (serve_bench --sampling): greedy, or an OpenAI client's usual temperature and top-p
SAMPLING: dict[str, dict] = {"greedy": {}, "top_p": {"temperature": 0.7, "top_p": 0.9}}


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    image_png: bytes | None
    more_images: tuple[bytes, ...] = ()  # after image_png, in the order of the prompt's image marks (chat turns)
    max_new_tokens: int | None = None  # this request's own (mixed-length loads); None: the run's
    messages: tuple[Message, ...] = ()  # the same request for the OpenAI chat API

    @property
    def images(self) -> list[bytes]:
        return ([self.image_png] if self.image_png is not None else []) + list(self.more_images)

    def new_tokens(self, default: int) -> int:
        return default if self.max_new_tokens is None else self.max_new_tokens

    def body(self, max_new_tokens: int, json_schema: dict | None = None, sampling: str = "greedy") -> bytes:
        """LightLLM's /generate_stream JSON: greedy (the default) or sampled as SAMPLING[sampling] says, EOS
        ignored, the images as base64; `max_new_tokens` unless the request has its own; with `json_schema`, the
        output follows it (LightLLM's guided_json)."""
        params = {"max_new_tokens": self.new_tokens(max_new_tokens), "ignore_eos": True}
        if SAMPLING[sampling]:
            params.update(do_sample=True, **SAMPLING[sampling])
        if json_schema is not None:
            params["guided_json"] = json_schema
        data: dict = {"inputs": self.prompt, "parameters": params}
        if self.images:
            items = [{"type": "base64", "data": base64.b64encode(png).decode()} for png in self.images]
            data["multimodal_params"] = {"images": items}
        return json.dumps(data).encode()

    def openai_body(
        self, max_new_tokens: int, model: str | None, json_schema: dict | None = None, sampling: str = "greedy"
    ) -> bytes:
        """The OpenAI /v1/chat/completions JSON of the same work: the messages (images as data: URLs), greedy
        (temperature 0) or sampled as SAMPLING[sampling] says, EOS ignored (`ignore_eos`, an extra field vLLM and
        mmserve take), streamed with usage (`include_usage` for the final count; `continuous_usage_stats`, vLLM's,
        for each chunk's count so far); with `json_schema`, OpenAI's response_format json_schema."""
        if not self.messages:
            raise ValueError("this request has no chat messages for the OpenAI API")
        data: dict = {
            "messages": [m.openai() for m in self.messages],
            "max_tokens": self.new_tokens(max_new_tokens),
            "temperature": 0,
            **SAMPLING[sampling],
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if model:
            data["model"] = model
        if json_schema is not None:
            data["response_format"] = {"type": "json_schema", "json_schema": {"name": "load", "schema": json_schema}}
        return json.dumps(data).encode()


def load_index(load: Load) -> int:
    """1-based: load i's seeds start at i * 100_000, apart from every other load's."""
    return list(LOADS).index(load.name) + 1


# Seeds of round r start r * ROUND_STRIDE higher: apart from every load's own range (load index * 100_000).
ROUND_STRIDE = 10_000_000


def requests_for(
    load: Load, family: str, n_words: int = 64, image_round: int = 0
) -> tuple[list[RequestSpec], RequestSpec | None]:
    """(timed requests, the cache-warming request sent before them or None). Question i of every load is the same
    text (so text_x64 is img336_x64 with the image removed; a mixed-length load's has its own length); image seeds are
    unique per load and request, and per `image_round`: a repeat of a load against one running server with a new
    round misses the embedding cache. A mixed load's lengths and sizes stay the same from round to round."""
    if load.is_chat:
        raise ValueError(f"{load.name} is a multi-turn chat: its requests depend on the answers (chat_conversations)")
    base = load_index(load) * 100_000 + image_round * ROUND_STRIDE
    shared = random_png(base + 99_999, load.size) if load.same_image and load.size is not None else None
    shapes = request_shapes(load, n_words)
    specs = []
    for i, shape in enumerate(shapes):
        image = shared
        if image is None and shape.image is not None:
            image = random_png(base + i, *shape.image)
        specs.append(single_turn(family, question(i, shape.words), image, shape.new_tokens))
    warm = None
    if shared is not None:  # the first question about the image: not one of the timed 64
        warm = single_turn(family, question(99_999, n_words), shared)
    return specs, warm


def single_turn(family: str, text: str, image: bytes | None, max_new_tokens: int | None = None) -> RequestSpec:
    messages = chat_messages(family, [(text, image)], [])
    return RequestSpec(build_prompt(family, text, image is not None), image, (), max_new_tokens, messages)


@dataclass(frozen=True)
class Shape:
    """One request's lengths: words in its question, its image's (width, height) or None, its new tokens (None:
    the run's)."""

    words: int
    image: tuple[int, int] | None
    new_tokens: int | None


def request_shapes(load: Load, n_words: int = 64) -> list[Shape]:
    """Each request's lengths: fixed ones from the load (or `n_words`), and a mixed load's drawn uniformly within
    its bounds from a generator seeded by the load's name, so every run and server gets the same."""
    rng = random.Random(f"{load.name}:shapes")
    shapes = []
    for _ in range(load.num):
        words = rng.randint(*load.word_range) if load.word_range else n_words
        image = (load.size, load.size) if load.size is not None else None
        if load.size_range:
            image = (rng.randint(*load.size_range), rng.randint(*load.size_range))
        new_tokens = rng.randint(*load.new_token_range) if load.new_token_range else None
        shapes.append(Shape(words, image, new_tokens))
    return shapes


def poisson_arrivals(rate: float, num: int, seed: str | int) -> list[float]:
    """Send times in s of `num` requests arriving as a Poisson process at `rate` per second: exponential gaps of
    mean 1/rate from a seeded generator, the first request at 0."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in range(num - 1)]
    return [0.0, *itertools.accumulate(gaps)] if num > 0 else []


def arrival_times(load: Load) -> list[float] | None:
    """The load's send times from its start (seeded by its name), or None when every request goes at once."""
    if load.rate is None or load.sequential:
        return None
    return poisson_arrivals(load.rate, load.num, f"{load.name}:arrivals")


def warmup_requests(loads: list[Load], family: str, n_words: int = 64) -> list[RequestSpec]:
    """Two requests of each kind the loads use (text, and each image size), with images no load uses."""
    kinds = sorted({size for load in loads for size in (load.image_sizes or {0})})
    out = []
    for k, size in enumerate(kinds):
        for j in range(2):
            image = random_png(900_000 + 10 * k + j, size) if size else None
            out.append(single_turn(family, question(900_000 + j, n_words), image))
    return out
