"""HF transformers `generate` on the serving benchmark's work: same checkpoint, images, prompt and token counts."""

from __future__ import annotations

import time

import torch
from PIL import Image

from mmserve.tokenizers import load_tokenizer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _llava_inputs(model_dir: str, prompt: str, images: list[Image.Image], tokenizer):
    from transformers import CLIPImageProcessor, LlavaForConditionalGeneration

    model = (
        LlavaForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float16 if DEVICE == "cuda" else torch.float32
        )
        .to(DEVICE)
        .eval()
    )
    image_token = model.config.image_token_id
    pixels = CLIPImageProcessor.from_pretrained(model_dir)(images, return_tensors="pt").pixel_values
    num = (model.config.vision_config.image_size // model.config.vision_config.patch_size) ** 2
    head, tail = prompt.split("<image>")
    ids = tokenizer(head).input_ids + [image_token] * num + tokenizer(tail, add_special_tokens=False).input_ids
    batches = [{"input_ids": torch.tensor([ids]), "pixel_values": pixels[i : i + 1]} for i in range(len(images))]
    return model, batches


def _qwen2_vl_inputs(model_dir: str, prompt: str, images: list[Image.Image], tokenizer):
    from transformers import Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    model = (
        Qwen2VLForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32
        )
        .to(DEVICE)
        .eval()
    )
    proc = Qwen2VLImageProcessor.from_pretrained(model_dir)
    batches = []
    for image in images:
        out = proc([image], return_tensors="pt")
        n = int(out.image_grid_thw.prod()) // proc.merge_size**2
        text = prompt.replace("<|image_pad|>", "<|image_pad|>" * n)
        batches.append(
            {
                "input_ids": torch.tensor([tokenizer(text).input_ids]),
                "pixel_values": out.pixel_values,
                "image_grid_thw": out.image_grid_thw,
            }
        )
    return model, batches


def _collate(items: list[dict], pad_id: int) -> dict:
    """Left-pad input ids to one batch; image tensors concatenate."""
    width = max(it["input_ids"].shape[1] for it in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, it in enumerate(items):
        n = it["input_ids"].shape[1]
        ids[i, width - n :] = it["input_ids"][0]
        mask[i, width - n :] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    for key in items[0]:
        if key != "input_ids":
            batch[key] = torch.cat([it[key] for it in items])
    return batch


@torch.inference_mode()
def run_hf(family: str, model_dir: str, prompt: str, images: list[Image.Image], new_tokens: int, batch: int) -> dict:
    tokenizer = load_tokenizer(model_dir)
    build = {"llava": _llava_inputs, "qwen2_vl": _qwen2_vl_inputs}[family]
    model, items = build(model_dir, prompt, images, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad

    def generate(chunk: list[dict]) -> None:
        inputs = {k: v.to(DEVICE) for k, v in _collate(chunk, pad).items()}
        model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    generate(items[:2])  # warm-up
    _sync()
    t0 = time.perf_counter()
    for i in range(0, len(items), batch):
        generate(items[i : i + batch])
    _sync()
    wall = time.perf_counter() - t0
    return {"req_per_s": len(items) / wall, "out_tok_per_s": len(items) * new_tokens / wall, "wall_s": wall}
