"""A multi-turn chat about two images over the OpenAI API (/v1/chat/completions with the `openai` client), streamed:
the first turn sends both pictures with a question, each reply is printed as it is generated and kept in the
history, and the follow-up questions are asked about the same pictures. The server renders the prompt from the
checkpoint's chat template (or its family's built-in one). With no --images it draws two small pictures on the fly.

python -m mmserve.api_server --port 8080 --enable_multimodal &    # the demo Qwen2-VL, or --model_dir <a VLM>
python examples/openai_multiturn_images.py --base_url http://127.0.0.1:8080/v1 --images a.jpg https://host/b.png
"""

from __future__ import annotations

import argparse
import base64
import io
import mimetypes

from openai import OpenAI
from PIL import Image, ImageDraw

QUESTIONS = [
    "Here are two pictures. What does each one show?",
    "Which of the two is brighter?",
    "Describe the first picture in one sentence.",
]


def drawn_picture(sky: tuple[int, int, int], sun: tuple[int, int, int]) -> str:
    """A 96x64 landscape as a PNG data: URL, so the example needs no file."""
    image = Image.new("RGB", (96, 64), sky)
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 44, 96, 64), fill=(34, 139, 34))
    draw.ellipse((60, 6, 84, 30), fill=sun)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_url(source: str) -> str:
    """http(s) URLs go as they are (the server fetches them); a local file is sent inline as a data: URL."""
    if source.startswith(("http://", "https://")):
        return source
    with open(source, "rb") as f:
        data = f.read()
    mime = mimetypes.guess_type(source)[0] or "image/png"
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--base_url", default="http://127.0.0.1:8080/v1", help="the server's OpenAI API (default: %(default)s)"
    )
    ap.add_argument("--images", nargs=2, default=None, metavar="PATH_OR_URL", help="omitted: two drawn pictures")
    ap.add_argument("--turns", type=int, default=len(QUESTIONS), choices=range(1, len(QUESTIONS) + 1))
    ap.add_argument("--max_tokens", type=int, default=64)
    args = ap.parse_args()

    if args.images:
        urls = [image_url(s) for s in args.images]
    else:
        urls = [drawn_picture((135, 206, 235), (255, 215, 0)), drawn_picture((25, 25, 80), (240, 240, 255))]
    client = OpenAI(base_url=args.base_url, api_key="unused")  # the server checks no key
    model = client.models.list().data[0].id

    first = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    messages: list[dict] = []
    for turn, question in enumerate(QUESTIONS[: args.turns], start=1):
        content = [*first, {"type": "text", "text": question}] if turn == 1 else question
        messages.append({"role": "user", "content": content})
        print(f"[user {turn}] {question}")
        print(f"[assistant {turn}] ", end="", flush=True)
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.max_tokens, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        reply = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                reply.append(chunk.choices[0].delta.content)
                print(chunk.choices[0].delta.content, end="", flush=True)
            if chunk.usage is not None:
                print(f"\n[usage {turn}] {chunk.usage.model_dump_json(include={'prompt_tokens', 'completion_tokens'})}")
        messages.append({"role": "assistant", "content": "".join(reply)})


if __name__ == "__main__":
    main()
