"""Synthetic test clips written with PyAV, and the frames and metadata HF's video processor takes for them."""

from __future__ import annotations

import io
import os
import tempfile

import numpy as np
from transformers.video_utils import VideoMetadata


def clip(width: int, height: int, seconds: float, fps: int, seed: int) -> bytes:
    """An MP4 (H.264) of seeded moving noise: each frame differs, so sampling the wrong frames changes the answer.
    Its index comes first (`faststart`, as web videos have it), so a cut-off copy still says how many frames it had."""
    import av

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "clip.mp4")
        _write(path, base, int(seconds * fps), fps, av)
        with open(path, "rb") as f:
            return f.read()


def _write(path: str, base: np.ndarray, count: int, fps: int, av) -> None:
    height, width = base.shape[:2]
    with av.open(path, mode="w", format="mp4", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(count):
            frame = np.roll(base, shift=3 * i, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def decoded(data: bytes) -> tuple[np.ndarray, VideoMetadata]:
    """Every frame of `data` ([frames, height, width, 3] RGB) and its metadata, as HF's processor takes a video to
    sample itself (do_sample_frames=True)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        fps, total = float(stream.average_rate), stream.frames
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert len(frames) == total, (len(frames), total)
    meta = VideoMetadata(total_num_frames=total, fps=fps, width=frames.shape[2], height=frames.shape[1],
                         duration=total / fps, video_backend="pyav")  # fmt: skip
    return frames, meta
