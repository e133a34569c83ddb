"""Qwen3-VL's video arithmetic: which frames the checkpoint's `Qwen3VLVideoProcessor` samples, the patch grid it
makes of them (its own `smart_resize`, whose pixel bounds cover all the sampled frames together, and its per-frame
cap), and the timestamp of each temporal patch that `Qwen3VLProcessor` writes into the prompt (`<t seconds>` before
each patch's vision block: the mean time of the frames it merges, the last frame repeated to fill the last patch).

The prompt side expands the video placeholder with it and the preprocessing workers decode exactly those frames, as
for Qwen2-VL (families/qwen2_vl_video.py, whose `VideoPlan` and sampling parameters this shares).
"""

from __future__ import annotations

import math

import numpy as np
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
from transformers.video_utils import VideoMetadata

from families.qwen2_vl_video import VideoPlan, sample_kwargs, size_of


def max_video_pixels(processor, size: dict, num_frames: int) -> int:
    """The pixel bound of all `num_frames` resized frames together, as the processor's `resize` sets it."""
    if not processor.cap_pixels_per_frame:
        return size["longest_edge"]
    factor = processor.patch_size * processor.merge_size
    frame_cap = processor.max_video_tokens * factor * factor
    per_frame = max(min(frame_cap, size["longest_edge"] // num_frames), int(size["shortest_edge"] * 1.05))
    return per_frame * num_frames


def patch_timestamps(indices: np.ndarray, fps: float, temporal_patch_size: int) -> tuple[float, ...]:
    """Seconds of each temporal patch: `Qwen3VLProcessor._calculate_timestamps`'s arithmetic."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [int(i) / fps for i in padded]
    return tuple(
        (seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)
    )


def plan_video(processor, metadata: VideoMetadata, sampling: dict) -> VideoPlan:
    """What `processor` (a Qwen3VLVideoProcessor) makes of a video with this metadata. ValueError for sampling
    parameters (or a video) the processor refuses."""
    indices = np.asarray(processor.sample_frames(metadata, **sample_kwargs(sampling)))
    if len(indices) == 0:
        raise ValueError("no frame would be sampled from this video")
    size = size_of(processor, sampling)
    factor = processor.patch_size * processor.merge_size
    temporal = processor.temporal_patch_size
    height, width = smart_resize(len(indices), metadata.height, metadata.width, temporal, factor,
                                 size["shortest_edge"], max_video_pixels(processor, size, len(indices)))  # fmt: skip
    grid = (math.ceil(len(indices) / temporal), height // processor.patch_size, width // processor.patch_size)
    sampled_fps = len(indices) / metadata.total_num_frames * metadata.fps
    return VideoPlan(tuple(int(i) for i in indices), height, width, grid, temporal / sampled_fps,
                     patch_timestamps(indices, metadata.fps, temporal))  # fmt: skip
