"""Multi-turn, two-image Qwen-VL-Chat client, as in LightLLM's documentation: ChatML turns joined by newlines, one
empty `<img></img>` per image (matched in order to `multimodal_params.images`), stop sequences on the ChatML markers.

    python examples/qwen_vl_chat_multiturn.py --port 8080 --images chongqing.jpg http://host/beijing.jpg
"""

from __future__ import annotations

import argparse
import base64
import json
import urllib.error
import urllib.request


def image_item(source: str) -> dict:
    """The client rule: a string starting with http is sent as a URL, anything else is read and sent as base64."""
    if source.startswith("http"):
        return {"type": "url", "data": source}
    with open(source, "rb") as f:
        return {"type": "base64", "data": base64.b64encode(f.read()).decode("utf-8")}


def build_prompt(num_images: int) -> str:
    turns = [
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>",
        "<|im_start|>user\n"
        + "".join("<img></img>\n" for _ in range(num_images))
        + "Which two cities are shown in these pictures? Compare them.<|im_end|>",
        "<|im_start|>assistant\nThe pictures show Chongqing and Beijing.<|im_end|>",
        "<|im_start|>user\nWhere are these two cities?<|im_end|>",
        "<|im_start|>assistant\n",
    ]
    return "\n".join(turns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="the server's address (default: %(default)s)")
    ap.add_argument("--port", type=int, default=8080, help="the server's port (default: %(default)s)")
    ap.add_argument("--images", nargs=2, required=True, metavar="PATH_OR_URL", help="the two pictures, in order")
    ap.add_argument("--max_new_tokens", type=int, default=200)
    args = ap.parse_args()

    payload = {
        "inputs": build_prompt(len(args.images)),
        "parameters": {"max_new_tokens": args.max_new_tokens, "stop_sequences": ["<|im_end|>", "<|im_start|>"]},
        "multimodal_params": {"images": [image_item(s) for s in args.images]},
    }
    request = urllib.request.Request(
        f"http://{args.host}:{args.port}/generate",
        data=json.dumps(payload).encode("utf-8"),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"error {e.code}: {e.read().decode('utf-8', 'replace')}") from None
    print(json.dumps(answer, ensure_ascii=False, indent=2))


if __name__ == "__main__":
    main()
