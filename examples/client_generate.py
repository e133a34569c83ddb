"""Send one text request to a running server's /generate (LightLLM's request shape) and print the JSON answer.

python -m mmserve.api_server --port 8080 &      # or: mmserve --model_dir /path/to/llama --port 8080
python examples/client_generate.py --prompt "What is AI?" --max_new_tokens 17
"""

from __future__ import annotations

import argparse
import json

import httpx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="the server (default: %(default)s)")
    ap.add_argument("--prompt", default="What is AI?")
    ap.add_argument("--max_new_tokens", type=int, default=17)
    ap.add_argument("--frequency_penalty", type=float, default=1.0)
    ap.add_argument("--details", action="store_true", help="also return every token's id, text and logprob")
    args = ap.parse_args()

    data = {
        "inputs": args.prompt,
        "parameters": {
            "do_sample": False,
            "ignore_eos": False,
            "max_new_tokens": args.max_new_tokens,
            "frequency_penalty": args.frequency_penalty,
            "return_details": args.details,
        },
    }
    response = httpx.post(f"{args.url}/generate", json=data, timeout=600)
    print(json.dumps(response.json(), ensure_ascii=False, indent=2))
    response.raise_for_status()


if __name__ == "__main__":
    main()
