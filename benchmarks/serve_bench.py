"""Serving benchmark: N concurrent image requests against a real mmserve server, then HF transformers `generate`
on the same model, images and prompts in the same run.

    python benchmarks/serve_bench.py --family llava --model_dir /tmp/llava7b --num_requests 64 --sizes 336x336
    python benchmarks/serve_bench.py --family qwen2_vl --model_dir /tmp/qwen2vl7b --num_requests 32 \
        --sizes 336x336,448x672,896x896,640x480

Every request has its own random image (no cache hits), greedy, `max_new_tokens` new tokens with EOS ignored, sent
as base64 PNG over `/generate_stream`; first-token time is the first streamed piece."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np
from PIL import Image

IMAGE_MARK = {"llava": "<image>\n", "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>"}
PROMPTS = {
    "llava": "USER: <image>\nDescribe this picture in detail. ASSISTANT:",
    "qwen2_vl": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this picture in detail."
    "<|im_end|>\n<|im_start|>assistant\n",
}


def make_images(n: int, sizes: list[tuple[int, int]], seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    images = []
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        images.append(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
    return images


def png_b64(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, image_b64: str, new_tokens: int) -> dict:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}}
    if image_b64:
        body["multimodal_params"] = {"images": [{"type": "base64", "data": image_b64}]}
    t0 = time.perf_counter()
    first, count = None, 0
    async with client.stream("POST", url + "/generate_stream", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if first is None:
                first = time.perf_counter() - t0
            if event.get("finished"):
                count = event["count_output_tokens"]
    total = time.perf_counter() - t0
    return {"ttft": first, "latency": total, "tokens": count}


async def run_load(url: str, prompt: str, images_b64: list[str], new_tokens: int) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=len(images_b64) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, prompt, b, new_tokens) for b in images_b64))
        return results, time.perf_counter() - t0


def start_server(args) -> tuple[subprocess.Popen, float]:
    cmd = [
        sys.executable,
        "-m",
        "mmserve.api_server",
        "--model_dir",
        args.model_dir,
        "--port",
        str(args.port),
        "--enable_multimodal",
        "--cache_capacity",
        "512",
        "--max_total_token_num",
        str(args.max_total_token_num),
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=sys.stdout, stderr=sys.stderr)
    url = f"http://127.0.0.1:{args.port}"
    while time.perf_counter() - t0 < 600:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not become healthy")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def bench_server(args, prompt: str, images: list[Image.Image]) -> dict:
    proc, startup = start_server(args)
    url = f"http://127.0.0.1:{args.port}"
    try:
        warm = make_images(4, [images[0].size], seed=999)
        asyncio.run(run_load(url, prompt, [png_b64(i) for i in warm], 8))
        results, wall = asyncio.run(run_load(url, prompt, [png_b64(i) for i in images], args.max_new_tokens))
        if args.also_text_only:  # the same load without images: separates the visual pipeline from the engine
            text_prompt = prompt.replace(IMAGE_MARK[args.family], "")
            text_results, text_wall = asyncio.run(run_load(url, text_prompt, [""] * len(images), args.max_new_tokens))
            print("text-only:", json.dumps(summarize(text_results, text_wall)), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert all(r["tokens"] == args.max_new_tokens for r in results), "a request ended early"
    return {"startup_s": round(startup, 1), **summarize(results, wall)}


def summarize(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results]
    tpot = [(r["latency"] - r["ttft"]) / max(1, r["tokens"] - 1) for r in results]
    return {
        "req_per_s": len(results) / wall,
        "out_tok_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_ms": statistics.median(tpot) * 1e3,
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=sorted(PROMPTS), required=True)
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--num_requests", type=int, default=64)
    ap.add_argument("--sizes", default="336x336")
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--max_total_token_num", type=int, default=100_000)
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--hf", action="store_true", help="also run HF transformers generate on the same work")
    ap.add_argument("--hf_batch", type=int, default=64)
    ap.add_argument("--also_text_only", action="store_true", help="then the same load without images")
    args = ap.parse_args()
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    images = make_images(args.num_requests, sizes, seed=0)
    prompt = PROMPTS[args.family]
    ours = bench_server(args, prompt, images)
    print("mmserve:", json.dumps({k: round(v, 4) for k, v in ours.items()}), flush=True)
    if args.hf:
        from benchmarks.hf_baseline import run_hf

        hf = run_hf(args.family, args.model_dir, prompt, images, args.max_new_tokens, args.hf_batch)
        print("hf:", json.dumps({k: round(v, 4) for k, v in hf.items()}), flush=True)
        print(f"speed-up (req/s): {ours['req_per_s'] / hf['req_per_s']:.2f}x")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
