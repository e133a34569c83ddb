"""Ask a running multimodal server about one image through the OpenAI API (/v1/chat/completions, the `openai`
client), the image sent as a base64 data: URL; prints the reply and the token usage. With no --image it draws a small
picture on the fly. The prompt is rendered by the server from the checkpoint's own chat template.

python -m mmserve.api_server --port 8080 --enable_multimodal &    # the demo Qwen2-VL, or --model_dir Qwen2-VL-*
python examples/openai_chat_image.py --base_url http://127.0.0.1:8080/v1 --image cat.jpg --stream
"""

from __future__ import annotations

import argparse
import base64
import io
import mimetypes

from openai import OpenAI
from PIL import Image, ImageDraw


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
    ap.add_argument(
        "--base_url", default="http://127.0.0.1:8080/v1", help="the server's OpenAI API (default: %(default)s)"
    )
    ap.add_argument("--image", default=None, help="an image file; omitted: a small picture drawn here")
    ap.add_argument("--question", default="Describe this picture.")
    ap.add_argument("--max_tokens", type=int, default=32)
    ap.add_argument("--stream", action="store_true", help="print the reply as it is generated")
    args = ap.parse_args()

    if args.image:
        with open(args.image, "rb") as f:
            data = f.read()
        mime = mimetypes.guess_type(args.image)[0] or "image/png"
    else:
        data, mime = drawn_png(), "image/png"
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"

    client = OpenAI(base_url=args.base_url, api_key="unused")  # the server checks no key
    model = client.models.list().data[0].id
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": args.question}],
        }
    ]
    if args.stream:
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.max_tokens, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
            if chunk.usage is not None:
                print(f"\n[usage] {chunk.usage.model_dump_json()}")
        return
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens)
    print(reply.choices[0].message.content)
    print(f"[finish_reason] {reply.choices[0].finish_reason}  [usage] {reply.usage.model_dump_json()}")


if __name__ == "__main__":
    main()
