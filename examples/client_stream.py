"""Stream one text request from a running server's /generate_stream and print the text as it arrives.

Each server-sent event is a line `data:{json}`; `data["token"]["text"]` is the new piece of text (as in LightLLM's
stream client) and the last event has `finished`, `finish_reason` and the whole `generated_text`.

    python -m mmserve.api_server --port 8080 &
    python examples/client_stream.py --prompt "What is AI?" --max_new_tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="the server (default: %(default)s)")
    ap.add_argument("--prompt", default="What is AI?")
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--stop", action="append", default=None, help="a stop sequence (repeatable)")
    args = ap.parse_args()

    parameters = {"do_sample": False, "ignore_eos": False, "max_new_tokens": args.max_new_tokens}
    if args.stop:
        parameters["stop_sequences"] = args.stop
    data = {"inputs": args.prompt, "parameters": parameters}
    with httpx.stream("POST", f"{args.url}/generate_stream", json=data, timeout=600) as response:
        if response.status_code != 200:
            response.read()
            sys.exit(f"error {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                sys.exit(f"\nserver error: {event['error']}")
            print(event["token"]["text"], end="", flush=True)
            if event["finished"]:
                print(f"\n[finish_reason={event['finish_reason']}, tokens={event['token']['count_output_tokens']}]")


if __name__ == "__main__":
    main()
