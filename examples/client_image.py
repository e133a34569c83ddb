"""Send one image and a question to a running Qwen2-VL server's /generate (LightLLM's request shape, the image as
base64 in `multimodal_params`) and print the JSON answer. With no --image it draws a small picture on the fly.

python -m mmserve.api_server --port 8080 --enable_multimodal &    # the demo Qwen2-VL, or --model_dir Qwen2-VL-*
python examples/client_image.py --url http://127.0.0.1:8080 --image cat.jpg --question "Describe this picture."
"""

from __future__ import annotations

import argparse
import base64
import io
import json

import httpx
from PIL import Image, ImageDraw

# Qwen2-VL's ChatML turn with one vision block: the server expands <|image_pad|> into the image's tokens.
PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"


def drawn_png() -> bytes:
    """A 96x64 picture (a sun over a field), so the example needs no file."""
    image = Image.new("RGB", (96, 64), (135, 206, 235))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 44, 96, 64), fill=(34, 139, 34))
    draw.ellipse((60, 6, 84, 30), fill=(255, 215, 0))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="the server (default: %(default)s)")
    ap.add_argument("--image", default=None, help="an image file; omitted: a small picture drawn here")
    ap.add_argument("--question", default="Describe this picture.")
    ap.add_argument("--max_new_tokens", type=int, default=32)
    args = ap.parse_args()

    if args.image:
        with open(args.image, "rb") as f:
            data = f.read()
    else:
        data = drawn_png()
    body = {
        "inputs": PROMPT.format(args.question),
        "parameters": {"max_new_tokens": args.max_new_tokens},
        "multimodal_params": {"images": [{"type": "base64", "data": base64.b64encode(data).decode()}]},
    }
    response = httpx.post(f"{args.url}/generate", json=body, timeout=600)
    print(json.dumps(response.json(), ensure_ascii=False, indent=2))
    response.raise_for_status()


if __name__ == "__main__":
    main()
