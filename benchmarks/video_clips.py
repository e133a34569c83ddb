"""Synthetic video clips for the video benchmark (benchmarks/video_bench.py), written with PyAV: seeded, each clip
different, with moving content so that the encoder cannot reduce them to a few bytes and the decoder has real work
(a panning textured background, a bouncing block and a moving patch of noise), MP4 with the index first.

H.264 (libx264) when PyAV's FFmpeg has it, else MPEG-4 part 2. Clips are written in parallel processes and kept in
a folder named by their parameters, so a second run on the same machine reads them back."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

CLIP_DIR = os.path.join(os.environ.get("TMPDIR", "/tmp"), "mmserve_video_clips")


@dataclass(frozen=True)
class ClipSpec:
    seconds: float
    width: int
    height: int
    fps: int
    seed: int

    @property
    def frames(self) -> int:
        return max(1, round(self.seconds * self.fps))


def clip_specs(num: int, seconds: float, width: int, height: int, fps: tuple[int, ...], seed: int) -> list[ClipSpec]:
    """`num` clips, clip i at frame rate fps[i % len(fps)] and seed seed + i."""
    return [ClipSpec(seconds, width, height, fps[i % len(fps)], seed + i) for i in range(num)]


def codec() -> str:
    import av

    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def render_frames(spec: ClipSpec):
    """The clip's frames, [height, width, 3] uint8 RGB each, made one at a time."""
    rng = np.random.default_rng(spec.seed)
    h, w = spec.height, spec.width
    # a smooth background: a coarse random field, each cell 16 px, blended along x (wide enough to pan over)
    coarse = rng.integers(0, 256, (h // 16 + 2, (2 * w) // 16 + 2, 3)).astype(np.float32)
    field = np.repeat(np.repeat(coarse, 16, axis=0), 16, axis=1)[:h, : 2 * w]
    field = ((field + np.roll(field, 8, axis=1) + np.roll(field, 8, axis=0)) / 3).astype(np.uint8)
    patch = rng.integers(0, 256, (max(1, h // 6), max(1, w // 8), 3), dtype=np.uint8)
    block = max(1, min(h, w) // 5)
    color = rng.integers(0, 256, 3, dtype=np.uint8)
    for i in range(spec.frames):
        x0 = (3 * i) % w
        frame = np.ascontiguousarray(field[:, x0 : x0 + w])
        bx, by = _bounce(5 * i, w - block), _bounce(3 * i + spec.seed, h - block)
        frame[by : by + block, bx : bx + block] = color
        px, py = _bounce(7 * i, w - patch.shape[1]), _bounce(2 * i, h - patch.shape[0])
        frame[py : py + patch.shape[0], px : px + patch.shape[1]] = np.roll(patch, i, axis=0)
        yield frame


def _bounce(t: int, span: int) -> int:
    """A position going back and forth over [0, span]."""
    if span <= 0:
        return 0
    t %= 2 * span
    return t if t <= span else 2 * span - t


def write_clip(spec: ClipSpec, path: str) -> str:
    import av

    tmp = path + ".part"
    with av.open(tmp, mode="w", format="mp4", options={"movflags": "faststart"}) as container:
        name = codec()
        stream = container.add_stream(name, rate=spec.fps)
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
        if name == "libx264":
            stream.options = {"preset": "veryfast", "crf": "23"}
        for frame in render_frames(spec):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    os.replace(tmp, path)
    return path


def clip_path(spec: ClipSpec, folder: str = CLIP_DIR) -> str:
    digest = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(folder, f"clip_{spec.width}x{spec.height}_{spec.seconds:g}s_{spec.fps}fps_{digest}.mp4")


def make_clips(specs: list[ClipSpec], folder: str = CLIP_DIR, procs: int | None = None) -> list[bytes]:
    """The clips' file bytes, written (in parallel) where not already in `folder`."""
    os.makedirs(folder, exist_ok=True)
    paths = [clip_path(s, folder) for s in specs]
    missing = [(s, p) for s, p in zip(specs, paths, strict=True) if not os.path.exists(p)]
    if len(missing) == 1:
        write_clip(*missing[0])
    elif missing:
        workers = procs or min(len(missing), os.cpu_count() or 1)
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(write_clip, *zip(*missing, strict=True)))
    out = []
    for p in paths:
        with open(p, "rb") as f:
            out.append(f.read())
    return out
