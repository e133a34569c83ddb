"""Video serving benchmark (issue 30): concurrent requests, one synthetic clip each (benchmarks/video_clips.py), against
a running server (`--url`) or an mmserve this script starts (`--model_dir`), then optionally HF transformers on the
same work (`--hf`, benchmarks/hf_video.py). One JSON line per run on stdout; progress and logs on stderr.

    python benchmarks/video_bench.py --model_dir /tmp/q2vl7b --startup --hf
    python benchmarks/video_bench.py --url http://127.0.0.1:18080 --loads video16_30s
    python benchmarks/video_bench.py --model_dir /tmp/q2vl7b --no_serve --hf      # HF alone

Load video16_30s: 16 requests at once, each a different 30 s 854x480 clip (24, 25 or 30 fps, H.264), sent through
`/v1/chat/completions` as a `video_url` data: URL (`--api lightllm`: `/generate_stream` with
`multimodal_params.videos`), frames sampled at `--video_fps` (2, sent as `mm_processor_kwargs`, HF's processor given
the same), 128 new tokens, greedy, EOS ignored, streamed. `--num_requests`, `--clip_seconds`, `--clip_size` and
`--clip_fps` shrink it (the CPU test runs 2 clips of 2 s).

Reported: req/s, output tok/s, TTFT and TPOT percentiles (benchmarks/bench_stats.py), prompt tokens, and per stage
(`stages`: mean per request and sum over the load, from the server's /metrics before and after the load):
`decode_sample` (a preprocessing worker's PyAV decoding, frame sampling and processor, per video:
mmserve_vision_preprocess_seconds{kind="video"}), `tower` (each video's share of its tower batches:
mmserve_vision_tower_seconds), `queue` (arrival to the engine's admission: HTTP intake, the video's probe, waiting
for its embeddings and for a KV slot), `prefill` (admission to the first token) and `decode` (first token to last).
vLLM's /metrics gives the last three under its names (vllm:request_*); a server without them reports null."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/video_bench.py` from anywhere

from benchmarks.bench_client import SENDERS, log, run_concurrent  # noqa: E402
from benchmarks.bench_stats import summarize  # noqa: E402
from benchmarks.loads import SYSTEM, question  # noqa: E402
from benchmarks.openai_stream import served_model  # noqa: E402
from benchmarks.serve_bench import add_server_flags, emit, start_server, stop_server  # noqa: E402
from benchmarks.video_clips import CLIP_DIR, clip_specs, codec, make_clips  # noqa: E402

VIDEO_MARK = "<|vision_start|><|video_pad|><|vision_end|>"
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# stage -> (the server's histogram, its label filter); vLLM's names for the request stages
STAGES = {
    "decode_sample": ("mmserve_vision_preprocess_seconds", 'kind="video"'),
    "tower": ("mmserve_vision_tower_seconds", 'kind="video"'),
    "queue": ("request_queue_time_seconds", ""),
    "prefill": ("request_prefill_time_seconds", ""),
    "decode": ("request_decode_time_seconds", ""),
}


@dataclass(frozen=True)
class VideoLoad:
    name: str
    num: int  # concurrent requests, one clip each
    seconds: float
    width: int
    height: int
    fps: tuple[int, ...]  # clip i's frame rate: fps[i % len(fps)]


VIDEO_LOADS = {load.name: load for load in (VideoLoad("video16_30s", 16, 30.0, 854, 480, (24, 25, 30)),)}


def prompt(text: str) -> str:
    """The chat prompt of one video and a question, as the Qwen-VL chat templates render the OpenAI messages."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{VIDEO_MARK}{text}<|im_end|>\n"
            "<|im_start|>assistant\n")  # fmt: skip


def request_body(api: str, clip: bytes, text: str, sampling: dict, new_tokens: int, model: str | None) -> bytes:
    data = base64.b64encode(clip).decode()
    if api == "openai":
        parts = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + data}},
                 {"type": "text", "text": text}]  # fmt: skip
        body = {
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}],
            "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "mm_processor_kwargs": sampling,
        }  # fmt: skip
        if model:
            body["model"] = model
        return json.dumps(body).encode()
    return json.dumps({
        "inputs": prompt(text),
        "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True},
        "multimodal_params": {"videos": [{"type": "base64", "data": data}], "mm_processor_kwargs": sampling},
    }).encode()  # fmt: skip


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def histogram_totals(text: str, name: str, labels: str = "") -> tuple[float, float] | None:
    """(sum, count) of a histogram in Prometheus text, over its samples whose labels contain `labels`; `name` is
    matched after any prefix (mmserve_, vllm:), so one stage name reads both servers. None where absent."""
    total, count, seen = 0.0, 0.0, False
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or labels not in (m.group(2) or ""):
            continue
        metric = m.group(1)
        for suffix in ("_sum", "_count"):
            if metric.endswith(name + suffix) and metric[: -len(name + suffix)] in ("", "mmserve_", "vllm:"):
                seen = True
                if suffix == "_sum":
                    total += float(m.group(3))
                else:
                    count += float(m.group(3))
    return (total, count) if seen else None


def scrape(url: str) -> str:
    try:
        return httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return ""


def stage_deltas(before: str, after: str) -> dict:
    """Each stage's mean per request and sum over the load (s), and its count, from two /metrics scrapes."""
    out = {}
    for stage, (name, labels) in STAGES.items():
        a, b = histogram_totals(before, name, labels), histogram_totals(after, name, labels)
        if a is None or b is None:
            out[stage] = None
            continue
        total, count = b[0] - a[0], b[1] - a[1]
        out[stage] = {"mean_s": total / count if count else None, "sum_s": total, "count": int(count)}
    return out


def load_work(load: VideoLoad, args: argparse.Namespace) -> tuple[list[bytes], list[str], dict]:
    """(the clips, one question each, the sampling parameters)."""
    specs = clip_specs(load.num, load.seconds, load.width, load.height, load.fps, args.seed)
    clips = make_clips(specs, args.clip_dir)
    questions = [question(i, args.question_words) for i in range(load.num)]
    sampling = {"fps": args.video_fps}
    if args.max_pixels:
        sampling["max_pixels"] = args.max_pixels
    return clips, questions, sampling


def describe(load: VideoLoad, clips: list[bytes], sampling: dict) -> dict:
    return {"clips": load.num, "clip_seconds": load.seconds, "clip_size": f"{load.width}x{load.height}",
            "clip_fps": list(load.fps), "codec": codec(), "clip_mb_total": sum(map(len, clips)) / 2**20,
            "sampling": sampling}  # fmt: skip


def warm_up(url: str, load: VideoLoad, args: argparse.Namespace) -> None:
    """Two short clips of the load's frame size (seeds no load uses): the tower's and the LM's first video shapes."""
    specs = clip_specs(2, 2.0, load.width, load.height, load.fps, 900_000)
    bodies = [request_body(args.api, c, question(900_000 + i, 8), {"fps": args.video_fps}, 8, args.model_name)
              for i, c in enumerate(make_clips(specs, args.clip_dir))]  # fmt: skip
    results, _, _ = asyncio.run(run_concurrent(url, bodies, "warm-up", args.timeout, progress=False, api=args.api))
    errors = [r.error for r in results if r.error]
    if len(errors) == len(results):
        raise SystemExit(f"every warm-up request failed, e.g. {errors[0]}")


def run_served(url: str, load: VideoLoad, args: argparse.Namespace) -> dict:
    clips, questions, sampling = load_work(load, args)
    bodies = [request_body(args.api, c, q, sampling, args.max_new_tokens, args.model_name)
              for c, q in zip(clips, questions, strict=True)]  # fmt: skip
    before = scrape(url)
    results, wall, cpu = asyncio.run(run_concurrent(url, bodies, load.name, args.timeout, api=args.api))
    summary = summarize(results, wall)
    summary["client_cpu_s"] = round(cpu, 2)
    summary["stages"] = stage_deltas(before, scrape(url))
    return {**describe(load, clips, sampling), **summary}


def run_hf(runner, load: VideoLoad, args: argparse.Namespace) -> dict:
    clips, questions, sampling = load_work(load, args)
    line = runner.run([prompt(q) for q in questions], clips, sampling, args.max_new_tokens, args.hf_batch)
    return {**describe(load, clips, sampling), **line}


def select(args: argparse.Namespace) -> list[VideoLoad]:
    out = []
    for name in (n.strip() for n in args.loads.split(",") if n.strip()):
        if name not in VIDEO_LOADS:
            raise SystemExit(f"unknown video load {name!r}; known: {', '.join(VIDEO_LOADS)}")
        load = VIDEO_LOADS[name]
        width, height = (int(x) for x in args.clip_size.split("x")) if args.clip_size else (load.width, load.height)
        fps = tuple(int(x) for x in args.clip_fps.split(",")) if args.clip_fps else load.fps
        out.append(VideoLoad(name, args.num_requests or load.num, args.clip_seconds or load.seconds, width, height,
                             fps))  # fmt: skip
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server; omitted: start mmserve here (--model_dir)")
    ap.add_argument("--name", default="mmserve", help='"server" in the JSON lines')
    ap.add_argument("--api", choices=tuple(SENDERS), default="openai")
    ap.add_argument("--model_name", default=None, help="--api openai: the model to name (default: /v1/models' first)")
    ap.add_argument("--family", choices=FAMILIES, default="qwen2_vl")
    ap.add_argument("--model_dir", default=None, help="checkpoint for the server started here, and for --hf")
    ap.add_argument("--loads", default="video16_30s", help=f"comma-separated: {', '.join(VIDEO_LOADS)}")
    ap.add_argument("--num_requests", type=int, default=None, help="clips (= concurrent requests) per load")
    ap.add_argument("--clip_seconds", type=float, default=None)
    ap.add_argument("--clip_size", default=None, help="WxH of the clips, e.g. 854x480")
    ap.add_argument("--clip_fps", default=None, help="the clips' frame rates, comma-separated, used in turn")
    ap.add_argument("--clip_dir", default=CLIP_DIR, help="where the clips are written and found again")
    ap.add_argument("--seed", type=int, default=0, help="clip i's seed is seed + i (another seed: other clips)")
    ap.add_argument("--video_fps", type=float, default=2.0, help="frames sampled per second (mm_processor_kwargs)")
    ap.add_argument("--max_pixels", type=int, default=None, help="per sampled frame (mm_processor_kwargs)")
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--question_words", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=900, help="per request, s")
    ap.add_argument("--no_warmup", action="store_true")
    ap.add_argument("--no_serve", action="store_true", help="no server run (with --hf: HF alone)")
    add_server_flags(ap)
    ap.add_argument("--hf", action="store_true", help="then HF transformers generate on the same work")
    ap.add_argument("--hf_batch", type=int, default=16, help="clips per HF generate (halved on out of memory)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    loads = select(args)
    common = {"server": args.name, "family": args.family, "api": args.api, "max_new_tokens": args.max_new_tokens}
    if not args.no_serve and loads:
        proc, url = None, args.url.rstrip("/") if args.url else None
        if url is None:
            proc, url, startup = start_server(args)
            if args.startup:
                emit({**common, "load": "start_to_healthy", "startup_s": startup})
        try:
            if args.api == "openai" and args.model_name is None:
                args.model_name = served_model(url)
            if not args.no_warmup:
                warm_up(url, loads[0], args)
            for load in loads:
                emit({**common, "load": load.name, **run_served(url, load, args)})
        finally:
            if proc is not None:
                stop_server(proc)
    if args.hf:
        if not args.model_dir:
            raise SystemExit("--hf needs --model_dir")
        from benchmarks.hf_video import HFVideoRunner

        runner = HFVideoRunner(args.family, args.model_dir)
        for load in loads:
            log(f"HF transformers on {load.name}")
            emit({**common, "server": "hf", "api": "generate", "load": load.name, **run_hf(runner, load, args)})


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
