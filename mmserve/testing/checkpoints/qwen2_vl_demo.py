"""The server's multimodal demo: a tiny random-weight Qwen2-VL in the published layout of Qwen2-VL-*-Instruct, with
the Instruct checkpoints' chat template in tokenizer_config.json and chat_template.json, as they ship it."""

from __future__ import annotations

import argparse
import json
import os

import torch

from mmserve.prep.chat_templates import QWEN2_VL
from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
from mmserve.testing.checkpoints.writer import write_json

# Qwen2-VL's chat template, as published with the Instruct checkpoints (the server's built-in one for the family).
CHAT_TEMPLATE = QWEN2_VL

# Images up to 448x448 pixels (1024 patches, 256 image tokens after the 2x2 merge): large enough to show the dynamic
# resolution at work, small enough that the tiny tower encodes one in well under a second on a laptop CPU.
DEMO_MAX_PIXELS = 448 * 448


def add_chat_template(model_dir: str, template: str = CHAT_TEMPLATE) -> None:
    """Put `template` where the published checkpoints carry it: `chat_template` of tokenizer_config.json (what
    AutoTokenizer reads) and chat_template.json (what AutoProcessor reads)."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config["chat_template"] = template
    write_json(path, config)
    write_json(os.path.join(model_dir, "chat_template.json"), {"chat_template": template})


def build_qwen2_vl_demo(out_dir: str, seed: int = 0) -> str:
    """The tiny Qwen2-VL in the published layout, one safetensors file, float32 (what a CPU computes in), with its
    chat template; returns out_dir."""
    build_qwen2_vl(out_dir, "tiny", torch.float32, max_pixels=DEMO_MAX_PIXELS, num_shards=None, seed=seed)
    add_chat_template(out_dir)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description="Write the multimodal demo checkpoint (tiny random Qwen2-VL)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    print(f"wrote the demo Qwen2-VL checkpoint to {build_qwen2_vl_demo(args.out)}")


if __name__ == "__main__":
    main()
