"""Check and time Qwen2-VL's packed vision attention on a GPU: run from the repo root on a CUDA host,

    python benchmarks/tower_bench.py                    # tiny + 7B-shaped towers, bf16
    python benchmarks/tower_bench.py --shapes tiny --iters 3

For each tower shape (random weights from mmserve/testing/checkpoints/qwen2_vl.py's specs, built in memory, no files):
1. torch's varlen flash kernel and ours (`visual/kernels/varlen_attention.py`, on CUDA) against per-image SDPA on
   packed random q/k/v of mixed sizes (the attention function alone; ours crosses partial key tiles here), then both
   timed on batches of one size (TFLOP/s);
2. our tower (`Qwen2VLVisionModel.encode`: our fused layers, packed attention, host-built index, pinned upload)
   against HF's tower with `sdpa` attention (one SDPA call per image per block) on a batch of mixed sizes and on one
   of a single size (ours inside both), within bf16 tolerance;
3. throughput, images/s, of both paths for 64 images at 336 px and 16 at 896 px (ours: the workers' uint8 images ->
   embeddings, the processor's float steps on the device; HF's: the processor's patches on the host -> embeddings);
4. on CUDA, one image alone (`--lone`, 336 and 896 px: one request's tower), ms per `encode` call, median, eager
   against the replay of its CUDA graph (`visual/tower_graphs.py`), the two checked bit-equal;
5. with `--profile N`, on CUDA, each load's N most costly kernels (device time per `encode`);
6. with `--attention_configs`, on CUDA, our attention kernel under other launches (tiles, warps, stages) against
   today's, on the 896 px x 4 and 336 px x 16 shapes, each checked against per-image SDPA there and on a ragged
   batch (partial tiles); the fastest correct launch per shape is printed last.
Prints one JSON line per measurement; exits non-zero if a check fails.

    python benchmarks/tower_bench.py --shapes 7b --loads "" --lone 336,896   # the lone-image latencies only
    python benchmarks/tower_bench.py --shapes 7b --loads "" --lone "" --attention_configs candidates,128x128x8x3
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2VLConfig, Qwen2VLImageProcessor
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/tower_bench.py` from anywhere

from benchmarks.profile_table import print_kernel_table  # noqa: E402
from mmserve.testing.checkpoints.qwen2_vl import CLIP_MEAN, CLIP_STD, qwen2_vl_config, vision_tensor_specs  # noqa: E402
from mmserve.testing.checkpoints.writer import make_tensor  # noqa: E402
from visual.kernels.varlen_attention import (  # noqa: E402
    CANDIDATES,
    AttentionConfig,
    head_dim_parts,
    varlen_attention,
    varlen_attention_ref,
)
from visual.models.base import ImageInput  # noqa: E402
from visual.models.packed_attention import (  # noqa: E402
    call_varlen,
    can_use_varlen,
    dense_attention,  # noqa: E402
    pack_index,
    sdpa_per_segment,
    torch_varlen_attn,
)
from visual.models.qwen2_vl import Qwen2VLVisionModel  # noqa: E402

PATCH, MERGE = 14, 2
CHECK_SIDES = [(336, 336), (896, 896), (448, 252), (1120, 644)]  # (width, height): mixed grids in one batch
UNIFORM_SIDES = [(448, 448)] * 3  # one size, 1024 patches each: the towers send such a batch to our kernel
ATTENTION_TIMINGS = [(4096, 4), (576, 16)]  # (patches per image, images): 896 px and 336 px batches


def build_towers(shape: str, dtype: torch.dtype, device: torch.device) -> tuple[Qwen2VLVisionModel, torch.nn.Module]:
    """Our vision model and HF's sdpa tower, with the same random weights."""
    cfg = qwen2_vl_config(shape, dtype)
    vision_config = Qwen2VLConfig(**cfg).vision_config
    generator = torch.Generator(device=device).manual_seed(0)
    state = {
        s.name: make_tensor(s, dtype, generator, str(device)) for s in vision_tensor_specs(cfg["vision_config"], "")
    }
    vision_config._attn_implementation = "sdpa"
    processor = Qwen2VLImageProcessor(image_mean=CLIP_MEAN, image_std=CLIP_STD)  # max_pixels 1003520: 896 px fits
    # Qwen2VLVisionModel swaps our layers into its own tower; the other stays HF's, with sdpa attention.
    ours = Qwen2VLVisionModel(_tower(vision_config, state, dtype, device), processor, cache_salt="bench")
    return ours, _tower(vision_config, state, dtype, device)


def _tower(vision_config, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    with torch.device(device):
        tower = Qwen2VisionTransformerPretrainedModel._from_config(copy.deepcopy(vision_config), dtype=dtype)
    missing, unexpected = tower.load_state_dict(state, strict=False)
    if unexpected or not all("inv_freq" in k for k in missing):
        raise ValueError(f"tower weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return tower.eval()


def random_images(ours: Qwen2VLVisionModel, sides: list[tuple[int, int]], seed: int = 0) -> list[ImageInput]:
    """Random images of each size (width, height), as the worker pool hands them to `encode` (uint8, resized)."""
    rng = np.random.default_rng(seed)
    return [ours.preprocess(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))) for w, h in sides]


def hf_inputs(ours: Qwen2VLVisionModel, images: list[ImageInput]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's tower inputs for the same images: the processor's patches [patches, C*T*P*P] on the host, the grids."""
    patches = ours.preprocessor().to_patches([im.pixel_values for im in images])
    return patches, torch.tensor([im.grid_thw for im in images])


@torch.inference_mode()
def hf_encode(tower: torch.nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The old path: patches uploaded as they are, grid on the device, HF's per-image SDPA attention."""
    device, dtype = tower.get_device(), tower.get_dtype()
    patches, grid = inputs
    return tower(patches.to(device=device, dtype=dtype), grid_thw=grid.to(device)).pooler_output  # [tokens, hidden]


def close(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    ours, ref = ours.float(), ref.float()
    err = (ours - ref).abs()
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min().item()
    rel_max = err.max().item() / ref.abs().max().item()
    rel_mean = err.mean().item() / ref.abs().mean().item()
    return {"rel_max": rel_max, "rel_mean": rel_mean, "min_cos": cos, "ok": rel_mean < 2e-2 and cos > 0.995}


def check_kernel(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> dict:
    cu = pack_index([(1, h // PATCH, w // PATCH) for w, h in CHECK_SIDES], MERGE).cu_seqlens.to(device)
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(int(cu[-1]), heads, head_dim, device=device, dtype=dtype, generator=g) for _ in "qkv")
    kernel = torch_varlen_attn()
    if not can_use_varlen(q, kernel):
        return {"varlen": False, "ok": True}
    max_len = int((cu[1:] - cu[:-1]).max())
    flash = call_varlen(kernel, q, k, v, cu, max_len, head_dim**-0.5)
    ref = sdpa_per_segment(*(t.transpose(0, 1)[None] for t in (q, k, v)), cu, head_dim**-0.5)[0]
    out = {"varlen": True, **close(flash, ref)}
    if head_dim_parts(head_dim) is not None:
        ours = close(varlen_attention(q, k, v, cu, max_len, head_dim**-0.5), ref)
        out["ours_ragged"] = ours  # reported, not yet required: the towers send ours only whole key tiles
    return out


def attention_timings(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, iters: int) -> list[dict]:
    """Torch's flash (the dense call the towers made for one-size batches) against our kernel, ms and TFLOP/s."""
    rows = []
    for length, images in ATTENTION_TIMINGS:
        g = torch.Generator(device=device).manual_seed(length)
        q, k, v = (
            torch.randn(length * images, heads, head_dim, device=device, dtype=dtype, generator=g) for _ in "qkv"
        )
        cu = torch.arange(0, (images + 1) * length, length, dtype=torch.int32, device=device)
        scale = head_dim**-0.5
        flash = lambda: dense_attention(q, k, v, images, scale)  # noqa: E731, B023 - called right here
        ours = lambda: varlen_attention(q, k, v, cu, length, scale)  # noqa: E731, B023
        flops = 4 * images * length * length * heads * head_dim
        row = {"patches": length, "images": images, **close(ours(), flash())}
        for name, fn in (("flash", flash), ("ours", ours)):
            ms = images_per_s(fn, 1, iters * 4, device) ** -1 * 1e3
            row[f"{name}_ms"], row[f"{name}_tflops"] = round(ms, 3), round(flops / ms / 1e9)
        rows.append(row)
    return rows


def parse_attention_configs(specs: str) -> list[AttentionConfig]:
    """`candidates` (the kernel module's list) and/or block_m x block_n x warps x stages specs, comma-separated."""
    configs: list[AttentionConfig] = []
    for spec in filter(None, specs.split(",")):
        configs.extend(CANDIDATES if spec == "candidates" else [AttentionConfig.parse(spec)])
    return configs


def _launch_row(fn: Callable[[], torch.Tensor], ref: torch.Tensor, flops: int, iters: int, device) -> dict:
    """One launch's check against the reference and its time; a launch that fails to compile or run is reported."""
    try:
        row = close(fn(), ref)
        ms = images_per_s(fn, 1, iters, device) ** -1 * 1e3
    except Exception as e:  # e.g. out of shared memory or registers for these tiles: not a candidate
        return {"ok": None, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {**row, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9)}


def attention_config_sweep(
    configs: list[AttentionConfig], device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, iters: int
) -> tuple[list[dict], bool]:
    """Our kernel under each launch against today's (config None) on the timed shapes: rows, and whether every
    launch that ran matched per-image SDPA (on the timed shapes, and on the ragged batch of CHECK_SIDES)."""
    rows, ok, scale = [], True, head_dim**-0.5
    ragged = pack_index([(1, h // PATCH, w // PATCH) for w, h in CHECK_SIDES], MERGE).cu_seqlens.to(device)
    shapes = [(int(ragged[-1]), ragged, int((ragged[1:] - ragged[:-1]).max()), "ragged")]
    for length, images in ATTENTION_TIMINGS:
        cu = torch.arange(0, (images + 1) * length, length, dtype=torch.int32, device=device)
        shapes.append((length * images, cu, length, f"{length}x{images}"))
    for tokens, cu, max_len, name in shapes:
        g = torch.Generator(device=device).manual_seed(tokens)
        q, k, v = (torch.randn(tokens, heads, head_dim, device=device, dtype=dtype, generator=g) for _ in "qkv")
        ref = varlen_attention_ref(q, k, v, cu, scale)
        flops = 4 * int(((cu[1:] - cu[:-1]) ** 2).sum()) * heads * head_dim
        today_ms = None
        for config in [None, *configs]:
            fn = lambda: varlen_attention(q, k, v, cu, max_len, scale, config)  # noqa: E731, B023 - called right here
            row = {
                "attention config": str(config or "today"),
                "shape": name,
                **_launch_row(fn, ref, flops, iters, device),
            }
            if config is None:
                today_ms = row.get("ms")
            elif today_ms and "ms" in row:
                row["speedup"] = round(today_ms / row["ms"], 3)
            ok &= row["ok"] is not False
            rows.append(row)
    return rows, ok


def best_launches(rows: list[dict]) -> dict[str, str]:
    """Per timed shape, the fastest launch whose output matched (today's included), as the kernel would name it."""
    best = {}
    for shape in {r["shape"] for r in rows if r["shape"] != "ragged"}:
        timed = [r for r in rows if r["shape"] == shape and r["ok"] and "ms" in r]
        best[shape] = min(timed, key=lambda r: r["ms"])["attention config"] if timed else None
    return best


def images_per_s(fn: Callable[[], object], images: int, iters: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):  # warm-up: kernels, allocator, pinned buffers
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return images * iters / (time.perf_counter() - start)


def median_ms(fn: Callable[[], object], iters: int) -> float:
    """Median wall time of fn() to the end of its GPU work, each call alone (a lone request's tower)."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def lone_image(ours: Qwen2VLVisionModel, side: int, iters: int) -> dict:
    """One side x side image alone through `encode`: eager, then replayed from its CUDA graph (captured on the second
    call, as in serving); ms per call and whether the embeddings are bit-equal."""
    image = random_images(ours, [(side, side)], seed=side + 1)[0]
    ours.graphs = None
    eager = ours.encode([image])[0]
    eager_ms = median_ms(lambda: ours.encode([image]), iters)
    ours.enable_cuda_graphs(max_patches=image.tower_rows)
    try:
        for _ in range(2):  # seen, then captured
            ours.encode([image])
        graphed = ours.encode([image])[0]
        graph_ms = median_ms(lambda: ours.encode([image]), iters)
        replays = ours.graphs.replays
    finally:
        ours.graphs = None
    ok = torch.equal(eager, graphed) and replays == iters + 1
    timings = {"eager_ms": round(eager_ms, 2), "graph_ms": round(graph_ms, 2), "speedup": round(eager_ms / graph_ms, 2)}
    return {"px": side, "patches": image.tower_rows, **timings, "replays": replays, "ok": ok}


def profile_encode(ours: Qwen2VLVisionModel, images: list[ImageInput], top: int, calls: int = 3) -> None:
    """Device time per kernel of one `encode` of the batch (`calls` averaged): where a tower batch's time goes."""
    from torch.profiler import ProfilerActivity, profile

    ours.encode(images)  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            ours.encode(images)
        torch.cuda.synchronize()
    print_kernel_table(prof, calls, top, f"per encode of {len(images)} images of {images[0].tower_rows} patches")


def bench_shape(
    shape: str,
    dtype: torch.dtype,
    device: torch.device,
    loads: list[tuple[int, ...]],
    iters: int,
    lone: list[int],
    attention_configs: list[AttentionConfig] = (),
    profile_top: int = 0,
) -> bool:
    """Checks and timings of one tower shape; True if the checks passed."""
    ours, hf = build_towers(shape, dtype, device)
    vc = hf.config
    kernel_check = check_kernel(device, dtype, vc.num_heads, vc.embed_dim // vc.num_heads)
    tower_checks = []
    with torch.inference_mode():
        for sides in (CHECK_SIDES, UNIFORM_SIDES):
            images = random_images(ours, sides)
            tower_checks.append(close(torch.cat(ours.encode(images)), hf_encode(hf, hf_inputs(ours, images))))
    print(json.dumps({"shape": shape, "check": "kernel", **kernel_check}))
    for sides, check in zip((CHECK_SIDES, UNIFORM_SIDES), tower_checks, strict=True):
        print(json.dumps({"shape": shape, "check": "tower vs HF sdpa", "sides": sides, **check}))
    if device.type == "cuda" and head_dim_parts(vc.embed_dim // vc.num_heads) is not None:
        for row in attention_timings(device, dtype, vc.num_heads, vc.embed_dim // vc.num_heads, iters):
            print(json.dumps({"shape": shape, "attention": "flash vs ours", **row}))
    sweep_ok = True
    if attention_configs and device.type == "cuda" and head_dim_parts(vc.embed_dim // vc.num_heads) is not None:
        rows, sweep_ok = attention_config_sweep(
            attention_configs, device, dtype, vc.num_heads, vc.embed_dim // vc.num_heads, iters * 8
        )
        for row in rows:
            print(json.dumps({"tower": shape, **row}))
        print(json.dumps({"tower": shape, "fastest correct launch": best_launches(rows), "all_matched": sweep_ok}))
    for side, batch in loads:
        imgs = random_images(ours, [(side, side)] * batch, seed=side)
        inputs = hf_inputs(ours, imgs)
        old = images_per_s(lambda: hf_encode(hf, inputs), batch, iters, device)  # noqa: B023 - called right here
        new = images_per_s(lambda: ours.encode(imgs), batch, iters, device)  # noqa: B023
        result = {"hf_sdpa_images_per_s": round(old, 1), "packed_images_per_s": round(new, 1)}
        print(json.dumps({"shape": shape, "px": side, "batch": batch, **result, "speedup": round(new / old, 2)}))
        if profile_top and device.type == "cuda":
            profile_encode(ours, imgs, profile_top)
    lone_ok = True
    for side in lone if device.type == "cuda" else ():
        row = lone_image(ours, side, iters * 4)
        print(json.dumps({"shape": shape, "lone image": "eager vs CUDA graph", **row}))
        lone_ok &= row["ok"]
    # On CUDA the check must have run the varlen kernel, not the fallback.
    towers_ok = all(check["ok"] for check in tower_checks) and lone_ok and sweep_ok
    return kernel_check["ok"] and towers_ok and (kernel_check["varlen"] or device.type != "cuda")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="tiny,7b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu only smoke-tests this script (the fallback path, fp32)")
    ap.add_argument("--loads", default="336x64,896x16", help="side x images per timed batch")
    ap.add_argument("--lone", default="336,896", help="sides of the lone images timed eager vs CUDA graph (CUDA)")
    ap.add_argument(
        "--attention_configs",
        default="",
        help="launches of our attention kernel to time against today's (CUDA): `candidates` (the kernel module's "
        "list) and/or BLOCK_MxBLOCK_NxWARPSxSTAGES, comma-separated",
    )
    ap.add_argument("--profile", type=int, default=0, help="after each load, its N most costly kernels (CUDA)")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    loads = [tuple(int(x) for x in load.split("x")) for load in args.loads.split(",") if load]
    attention_configs = parse_attention_configs(args.attention_configs)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(json.dumps({"torch": torch.__version__, "varlen_attn": torch_varlen_attn() is not None, "device": name}))
    ok = True
    for shape in args.shapes.split(","):
        lone = [int(x) for x in args.lone.split(",") if x]
        ok &= bench_shape(shape, dtype, device, loads, args.iters, lone, attention_configs, args.profile)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps({"all_checks_passed": bool(ok)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
