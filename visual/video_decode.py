"""Decoding video files with PyAV (transformers' `load_video` default backend), shared by the HTTP process (which reads
a video's header to expand the prompt) and the visual process's preprocessing workers (which decode the sampled
frames). It lives in `visual/` for the same reason as `visual/image_decode.py`: both sides import it.

The frames are read by transformers' own `read_video_pyav` from the bytes in memory, so that the frames a family's
video processor samples are the ones HF's reader gives it. Every way a file can be wrong raises `BadVideo`, a
`BadImage` (the server answers 400 with its message).
"""

from __future__ import annotations

import io

import numpy as np
from transformers.video_utils import VideoMetadata, read_video_pyav

from visual.image_decode import BadImage


class BadVideo(BadImage):
    """A video input that cannot be used; the message says why (shown to the client)."""


def probe_video(data: bytes) -> VideoMetadata:
    """The container's description of its first video stream (frame count, frame rate, size, duration), as
    `read_video_pyav` reads it, without decoding a frame."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise BadVideo("the file has no video stream")
            stream = container.streams.video[0]
            total, rate, width, height = int(stream.frames), stream.average_rate, stream.width, stream.height
    except BadVideo:
        raise
    except Exception as e:  # av.error.* (InvalidDataError, ...), and whatever a damaged header makes it raise
        raise BadVideo(f"data is not a readable video: {e}") from None
    if total < 1 or not rate or float(rate) <= 0:
        raise BadVideo("the video's container does not give its frame count and frame rate")
    if width < 1 or height < 1:
        raise BadVideo(f"the video has an empty frame size {width}x{height}")
    fps = float(rate)
    return VideoMetadata(total_num_frames=total, fps=fps, width=width, height=height, duration=total / fps,
                         video_backend="pyav")  # fmt: skip


def read_frames(data: bytes, indices: np.ndarray) -> np.ndarray:
    """The frames at `indices` (ascending), [frames, height, width, 3] uint8 RGB, read by transformers' PyAV reader.
    A file that ends before its last sampled frame (truncated, corrupt) is a BadVideo."""
    try:
        frames, _ = read_video_pyav(io.BytesIO(data), lambda metadata, **_: indices)
    except Exception as e:  # av.error.*, and numpy's stack of no frames at all
        raise BadVideo(f"video data is truncated or corrupt: {e}") from None
    if len(frames) != len(indices):
        raise BadVideo(f"video data is truncated or corrupt: {len(frames)} of its {len(indices)} sampled frames decode")
    return frames
