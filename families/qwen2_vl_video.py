"""Qwen2-VL's video arithmetic (also Qwen2.5-VL's): which frames the checkpoint's `Qwen2VLVideoProcessor` samples from
a video, the patch grid it makes of them, and the seconds one temporal patch spans (Qwen2.5-VL's M-RoPE time axis).
The prompt side expands the video placeholder with it and the preprocessing workers decode exactly those frames, so
both always agree. The sampling is the processor's own `sample_frames`; the resize is its `smart_resize` with the
bound its `resize` applies.

`sampling` is the request's effective sampling parameters (mm_processor_kwargs over the server's defaults), plain
JSON values: fps or num_frames, min_frames, max_frames, min_pixels, max_pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize
from transformers.video_utils import VideoMetadata

SAMPLE_KWARGS = ("fps", "num_frames", "min_frames", "max_frames")
SIZE_KWARGS = ("min_pixels", "max_pixels")
VIDEO_KWARGS = SAMPLE_KWARGS + SIZE_KWARGS  # what mm_processor_kwargs may set for a video


@dataclass(frozen=True)
class VideoPlan:
    indices: tuple[int, ...]  # the frames sampled, ascending
    height: int  # each frame resized to
    width: int
    grid_thw: tuple[int, int, int]  # patch grid (t, h, w); t = sampled frames / temporal_patch_size, rounded up
    second_per_grid_t: float  # seconds one temporal patch spans: temporal_patch_size / sampled fps
    # Qwen3-VL: each temporal patch's time in seconds, written before its own vision block in the prompt (each patch
    # is then a separate run of placeholders); empty: one run for the whole video (Qwen2-VL, Qwen2.5-VL)
    timestamps: tuple[float, ...] = ()

    @property
    def pixels(self) -> int:
        """Pixels of the sampled frames, resized."""
        return len(self.indices) * self.height * self.width


def sample_kwargs(sampling: dict) -> dict:
    return {k: sampling[k] for k in SAMPLE_KWARGS if sampling.get(k) is not None}


def size_of(processor, sampling: dict) -> dict:
    """The processor's `size` with the request's min/max pixels."""
    return {
        "shortest_edge": sampling.get("min_pixels") or processor.size.shortest_edge,
        "longest_edge": sampling.get("max_pixels") or processor.size.longest_edge,
    }


def plan_video(processor, metadata: VideoMetadata, sampling: dict) -> VideoPlan:
    """What `processor` (a Qwen2VLVideoProcessor) makes of a video with this metadata. ValueError for sampling
    parameters the processor refuses."""
    indices = np.asarray(processor.sample_frames(metadata, **sample_kwargs(sampling)))
    if len(indices) == 0:
        raise ValueError("no frame would be sampled from this video")
    size = size_of(processor, sampling)
    factor = processor.patch_size * processor.merge_size
    max_pixels = size["longest_edge"]
    if processor.cap_pixels_per_frame:  # the processor's `resize` bounds the whole video's pixels so
        total = int(processor.max_video_tokens * factor * factor * 0.9)
        max_pixels = max(min(max_pixels, total * processor.temporal_patch_size // len(indices)),
                         int(size["shortest_edge"] * 1.05))  # fmt: skip
    height, width = smart_resize(metadata.height, metadata.width, factor, size["shortest_edge"], max_pixels)
    t = math.ceil(len(indices) / processor.temporal_patch_size)
    grid = (t, height // processor.patch_size, width // processor.patch_size)
    sampled_fps = len(indices) / metadata.total_num_frames * metadata.fps  # VideoMetadata.sampled_fps
    return VideoPlan(tuple(int(i) for i in indices), height, width, grid,
                     processor.temporal_patch_size / sampled_fps)  # fmt: skip
