"""Video input through the real server, checked against HF transformers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; run from
each family's server module, on its server): short synthetic clips written with PyAV, decoded by the test with PyAV and
given to HF's processor (the checkpoint's video processor, sampling with the same fps), whose pixel_values_videos,
video_grid_thw (and Qwen2.5-VL's second_per_grid_ts) feed HF's generate. Greedy tokens and prompt token counts must
equal HF's, through /generate and /v1/chat/completions; a video with an image; a two-turn chat repeating the video
(encoded once, its prefix reused); the sampling parameters are part of the embedding cache key; a corrupt video or one
over a limit (bytes, duration, frames) gets a 400 naming the field, and the server goes back to idle: no KV slot or
cache entry held, no pixel segment left in /dev/shm, and goes on serving."""

from __future__ import annotations

import base64
import os
import re

import httpx
from transformers import AutoTokenizer, Qwen2VLImageProcessor

from families import family as family_spec
from mmserve.testing.images import picture, png_b64
from mmserve.testing.videos import clip, decoded
from tests.e2e import qwen_vl_cases as cases
from tests.models.hf_reference import hf_greedy
from tests.models.qwen_vl_harness import CHAT, VISION, QwenVLFamily

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
NEW_TOKENS = 12
FPS = 2.0  # sampling asked for in mm_processor_kwargs, and given to HF's processor
MAX_PIXELS = 28 * 28 * 12  # frames resized small: a short prompt for the tiny model on CPU
KWARGS = {"fps": FPS, "max_pixels": MAX_PIXELS}
CLIP = clip(112, 84, 3, 10, seed=1)  # 3 s at 10 fps: 6 frames sampled at 2 fps, 3 temporal patches
CLIP_2 = clip(84, 112, 2, 8, seed=2)
# The limits every family's server runs with: a clip sampled at a high fps is over --max_video_frames; HUGE (57 kB) is
# over --max_video_bytes, LONG (4 s) over --max_video_seconds, while CLIP (32 kB, 3 s) and CLIP_2 are within them
SERVER_ARGS = ("--max_video_frames", "16", "--max_video_bytes", "40000", "--max_video_seconds", "3.5")
HUGE = clip(224, 224, 1, 10, seed=4)
LONG = clip(32, 32, 4, 2, seed=3)


def hf_video_greedy(family: QwenVLFamily, model_dir: str, max_pixels: int = MAX_PIXELS):
    """HF's (greedy tokens, prompt length) for (text, images, videos) with the checkpoint's video processor (the
    family's class; its defaults where the checkpoint has none), frames resized within max_pixels (`.kwargs`: the
    same sampling as the server's mm_processor_kwargs)."""
    model = family.hf_model(model_dir)
    try:
        video_processor = family.video_processor_class.from_pretrained(model_dir)
    except OSError:
        video_processor = family.video_processor_class()
    processor = family.processor_class(
        image_processor=Qwen2VLImageProcessor.from_pretrained(model_dir),
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        video_processor=video_processor,
    )
    size = {"shortest_edge": video_processor.size.shortest_edge, "longest_edge": max_pixels}

    def greedy(text: str, images: list, videos: list[bytes], new_tokens: int = NEW_TOKENS) -> tuple[list[int], int]:
        frames, metadata = zip(*(decoded(v) for v in videos), strict=True)
        sampling = {"do_sample_frames": True, "fps": FPS, "size": size}
        inputs = processor(text=[text], images=images or None, videos=list(frames), video_metadata=list(metadata),
                           videos_kwargs=sampling, return_tensors="pt")  # fmt: skip
        extra = {k: v for k, v in inputs.items() if k != "input_ids"}
        ids = inputs["input_ids"][0].tolist()
        return hf_greedy(model, ids, new_tokens, **extra), len(ids)

    greedy.tokenizer = processor.tokenizer
    greedy.kwargs = {"fps": FPS, "max_pixels": max_pixels}
    # What the server renders chat with: the checkpoint's template, else its family's published one
    greedy.template = processor.tokenizer.chat_template or family_spec(family.arch).part("chat_template")
    return greedy


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def generate(server, prompt: str, videos: list[bytes], images=(), kwargs=KWARGS) -> httpx.Response:
    body = {
        "inputs": prompt,
        "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "return_details": True},
        "multimodal_params": {
            "images": [{"type": "base64", "data": png_b64(im)} for im in images],
            "videos": [{"type": "base64", "data": b64(v)} for v in videos],
            "mm_processor_kwargs": kwargs,
        },
    }
    return httpx.post(server.url + "/generate", json=body, timeout=300)


def tokens_and_prompt_len(r: httpx.Response) -> tuple[list[int], int]:
    assert r.status_code == 200, r.text
    body = r.json()
    return [t["id"] for t in body["tokens"]], body["prompt_tokens"]


def check_generate_equals_hf(server, hf) -> None:
    """One clip; then a clip and an image in one prompt (video first, as the prompt says)."""
    prompt = CHAT.format(VIDEO + "What happens in this video?")
    assert tokens_and_prompt_len(generate(server, prompt, [CLIP], kwargs=hf.kwargs)) == hf(prompt, [], [CLIP])
    image = picture(90, 60, 7)
    prompt = CHAT.format(VIDEO + "and" + VISION + "Does the picture appear in the video?")
    got = tokens_and_prompt_len(generate(server, prompt, [CLIP_2], [image], kwargs=hf.kwargs))
    assert got == hf(prompt, [image], [CLIP_2])


def chat(server, model: str, messages: list[dict], kwargs=KWARGS) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "mm_processor_kwargs": kwargs}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def check_two_turn_chat_equals_hf(server, hf, model: str) -> None:
    """A `video_url` part (data: URL) rendered by the checkpoint's template; the second turn repeats the video: the
    same answer as HF's, the video encoded once and the first turn's prefix reused."""
    video_part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(CLIP)}}
    first = [{"role": "user", "content": [video_part, {"type": "text", "text": "Describe it."}]}]
    hf_first = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe it."}]}]
    reply = chat(server, model, first, hf.kwargs)
    text = hf.tokenizer.apply_chat_template(hf_first, chat_template=hf.template, tokenize=False,
                                            add_generation_prompt=True)  # fmt: skip
    assert text.count(VIDEO) == 1
    ids, prompt_len = hf(text, [], [CLIP])
    assert reply["choices"][0]["message"]["content"] == hf.tokenizer.decode(ids, skip_special_tokens=True)
    assert reply["usage"]["prompt_tokens"] == prompt_len
    first_len = prompt_len - 1  # all of the first turn's prompt but its last token (which is always recomputed)

    answer = reply["choices"][0]["message"]["content"]
    encoded = server.metrics()[cases.ENCODED]
    again = {"type": "text", "text": "Again?"}
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": [video_part, again]}]
    hf_second = hf_first + [{"role": "assistant", "content": answer},
                            {"role": "user", "content": [{"type": "video"}, again]}]  # fmt: skip
    reply = chat(server, model, second, hf.kwargs)
    text = hf.tokenizer.apply_chat_template(hf_second, chat_template=hf.template, tokenize=False,
                                            add_generation_prompt=True)  # fmt: skip
    ids, prompt_len = hf(text, [], [CLIP, CLIP])
    assert reply["choices"][0]["message"]["content"] == hf.tokenizer.decode(ids, skip_special_tokens=True)
    assert reply["usage"]["prompt_tokens"] == prompt_len
    assert server.metrics()[cases.ENCODED] == encoded  # the same file, sampled the same way: one cache entry
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= first_len  # the first turn's KV, its video's


def check_bad_videos_get_400(server) -> None:
    prompt = CHAT.format(VIDEO + "What happens?")
    bad = [
        # cut off: its header (first) says 30 frames, the frames end early (the preprocessing worker finds it); then
        # a file with no index at all (the HTTP process finds it)
        (generate(server, prompt, [CLIP[: len(CLIP) * 6 // 10]]), "multimodal_params.videos"),
        (generate(server, prompt, [b"\x00\x00\x00\x18ftypmp42" + bytes(200)]), "multimodal_params.videos[0]"),
        (generate(server, prompt, [CLIP], kwargs={"fps": 2.0, "num_frames": 4}), "mm_processor_kwargs"),
        (generate(server, prompt, [CLIP], kwargs={"fpz": 2}), "mm_processor_kwargs.fpz"),
        (generate(server, prompt, [CLIP], kwargs={"fps": 60.0}), "multimodal_params.videos"),  # --max_video_frames
        (generate(server, CHAT.format("No placeholder."), [CLIP]), "multimodal_params.videos"),
        (generate(server, prompt, [HUGE]), "multimodal_params.videos[0]"),  # --max_video_bytes
        (generate(server, prompt, [LONG]), "multimodal_params.videos[0]"),  # --max_video_seconds
    ]
    for r, field in bad:
        assert r.status_code == 400, r.text
        assert r.json()["field"] == field, r.text
    assert "larger than 40000 bytes (--max_video_bytes)" in bad[-2][0].text
    assert "(--max_video_seconds)" in bad[-1][0].text
    check_idle(server)
    assert len(cases.generate(server, *cases.CASES[2], max_new_tokens=2)) == 2  # and the server keeps serving


def check_idle(server) -> None:
    """Nothing held after the refused requests: no KV slot, no cache entry in use, and in /dev/shm only the cache's
    own entries (named by their 32-hex-digit key), the visual process's spare segments and, on a GPU, its tower-turn
    flag (no preprocessing worker's pixels in transit)."""
    server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)
    server.wait_metric("mmserve_embed_cache_items_in_use", lambda v: v == 0)
    segments = [n for n in os.listdir("/dev/shm") if n.startswith(f"mmsv_{server.proc.pid}_")]
    entries = [n for n in segments if re.fullmatch("[0-9a-f]{32}", n.rsplit("_", 1)[-1])]
    others = [n for n in segments if n not in entries]
    assert all("spare" in n or n.endswith("_tower_turn") for n in others), segments
    assert len(entries) == server.metrics()["mmserve_embed_cache_items"], segments


def check_sampling_is_part_of_the_cache_key(server) -> None:
    """The same file sampled another way (fps, num_frames, min/max pixels from mm_processor_kwargs) is another
    embedding cache entry, encoded anew, with its own prompt length; the same sampling written in another order, or
    the server's default written out, is the same entry."""
    prompt = CHAT.format(VIDEO + "What happens?")

    def prompt_len_and_encodes(kwargs: dict | None) -> tuple[int, float]:
        before = server.metrics()[cases.ENCODED]
        r = generate(server, prompt, [CLIP_2], kwargs=kwargs)
        assert r.status_code == 200, r.text
        return r.json()["prompt_tokens"], server.metrics()[cases.ENCODED] - before

    base = {"fps": FPS, "max_pixels": MAX_PIXELS}
    first, encoded = prompt_len_and_encodes(base)
    assert encoded in (0, 1)  # an earlier test may have sent it
    assert prompt_len_and_encodes({"max_pixels": MAX_PIXELS, "fps": FPS}) == (first, 0)
    others = [
        {"fps": 4.0, "max_pixels": MAX_PIXELS},
        {"num_frames": 6, "max_pixels": MAX_PIXELS},
        {"fps": FPS, "max_pixels": MAX_PIXELS // 4},
        {"fps": FPS, "min_pixels": 2 * MAX_PIXELS, "max_pixels": 4 * MAX_PIXELS},  # CLIP_2 is below min_pixels
    ]
    lengths = [first]
    for kwargs in others:
        length, encoded = prompt_len_and_encodes(kwargs)
        assert encoded == 1, kwargs
        lengths.append(length)
    assert len(set(lengths)) == len(lengths), lengths  # each sampling gives another prompt: the sampling was applied
    assert prompt_len_and_encodes(base) == (first, 0)
