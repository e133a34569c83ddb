"""Request videos -> checked video bytes, their sampling plan and their cache key.

A video arrives as `multimodal_params.videos` entries ({"type": "base64" | "url", "data": ...}: data: URLs and
base64 as images are, URLs downloaded by the image URL fetcher under the same rules) or as an OpenAI `video_url`
part. The HTTP process reads only the container's header (frame count, frame rate, size: PyAV, in the image thread
pool, never on the event loop) and asks the family's prompt processor which frames its video processor samples and
the grid it makes of them; the visual process's preprocessing workers decode exactly those frames.

The sampling parameters are the request's `mm_processor_kwargs` (vLLM's name) over the checkpoint's video processor
and the server's --video_fps. They are part of the cache key: the same file sampled another way is another entry.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from cache.key import cache_key
from families.qwen2_vl_video import VIDEO_KWARGS
from mmserve.http.protocol import BadRequest
from mmserve.launch.config import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_VIDEO_BYTES,
    DEFAULT_MAX_VIDEO_FRAMES,
    DEFAULT_MAX_VIDEO_PIXELS,
    DEFAULT_MAX_VIDEO_SECONDS,
    DEFAULT_MAX_VIDEOS_PER_REQUEST,
    DEFAULT_VIDEO_FPS,
)
from mmserve.prep.multimodal.image_io import ImagePolicy, load_image_bytes
from visual.video_decode import BadVideo, probe_video

FIELD = "multimodal_params.videos"
KWARGS_FIELD = "mm_processor_kwargs"
_INT_KWARGS = ("num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels")


@dataclass(frozen=True)
class VideoPolicy:
    max_videos: int = DEFAULT_MAX_VIDEOS_PER_REQUEST  # --max_videos_per_request
    max_bytes: int = DEFAULT_MAX_VIDEO_BYTES  # --max_video_bytes: one file, as sent or downloaded
    max_seconds: float = DEFAULT_MAX_VIDEO_SECONDS  # --max_video_seconds: one file's duration
    max_frame_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # --max_image_pixels: one decoded frame, from the header
    max_frames: int = DEFAULT_MAX_VIDEO_FRAMES  # --max_video_frames: sampled frames, all videos of a request
    max_pixels: int = DEFAULT_MAX_VIDEO_PIXELS  # --max_video_pixels: resized sampled pixels, all videos of a request
    fps: float = DEFAULT_VIDEO_FPS  # --video_fps: sampling when nothing else sets it


@dataclass(frozen=True)
class LoadedVideo:
    data: bytes  # the file as sent (what the cache key hashes, with the sampling)
    key: str
    sampling: dict  # the effective sampling parameters (the encode job carries them to the worker)
    plan: object  # the family's plan (families/qwen2_vl_video.py: VideoPlan): indices, grid, seconds per patch


def request_sampling(kwargs: object, defaults: dict, policy: VideoPolicy) -> dict:
    """The effective sampling parameters of a request: its mm_processor_kwargs over the checkpoint's (`defaults`)
    and --video_fps. BadRequest naming the field for an unknown or ill-typed one."""
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise BadRequest(KWARGS_FIELD, "must be a JSON object")
    for name, value in kwargs.items():
        where = f"{KWARGS_FIELD}.{name}"
        if name not in VIDEO_KWARGS:
            raise BadRequest(where, f"unknown video processor parameter; accepted: {', '.join(VIDEO_KWARGS)}")
        if name in _INT_KWARGS and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise BadRequest(where, "must be a positive integer")
        if name == "fps" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
                              or not math.isfinite(value)):  # fmt: skip
            raise BadRequest(where, "must be a positive number")
    if "fps" in kwargs and "num_frames" in kwargs:
        raise BadRequest(KWARGS_FIELD, "fps and num_frames are mutually exclusive (the video processor's rule)")
    base = dict(defaults) if defaults else {"fps": policy.fps}
    if "fps" in kwargs or "num_frames" in kwargs:
        base.pop("fps", None)
        base.pop("num_frames", None)
    return {**base, **kwargs}


def video_key(data: bytes, sampling: dict, salt: str) -> str:
    return cache_key(data, salt + "\x00video:" + json.dumps(sampling, sort_keys=True))


def load_video(item: object, policy: VideoPolicy, salt: str, sampling: dict, plan_video) -> LoadedVideo:
    """One video entry (a URL entry already downloaded: its bytes) -> its bytes, sampling plan and cache key, in one
    thread-pool hop. `plan_video(metadata, sampling)`: the family's (ValueError for sampling it refuses)."""
    data = load_image_bytes(item, ImagePolicy(max_bytes=policy.max_bytes), what="video")
    metadata = probe_video(data)
    if metadata.duration > policy.max_seconds:
        raise BadVideo(f"video is {metadata.duration:.1f} s long, more than the limit of {policy.max_seconds:g} s "
                       "(--max_video_seconds)")  # fmt: skip
    if metadata.width * metadata.height > policy.max_frame_pixels:
        raise BadVideo(f"video frames are {metadata.width}x{metadata.height}, more than the limit of "
                       f"{policy.max_frame_pixels} pixels (--max_image_pixels)")  # fmt: skip
    try:
        plan = plan_video(metadata, sampling)
    except ValueError as e:
        raise BadVideo(f"cannot sample this video with {sampling}: {e}") from None
    return LoadedVideo(data, video_key(data, sampling, salt), sampling, plan)


def check_request_totals(videos: list[LoadedVideo], policy: VideoPolicy) -> None:
    frames = sum(len(v.plan.indices) for v in videos)
    if frames > policy.max_frames:
        raise BadRequest(FIELD, f"{frames} frames sampled from this request's videos, more than the limit of "
                                f"{policy.max_frames} (--max_video_frames); lower mm_processor_kwargs.fps")  # fmt: skip
    pixels = sum(v.plan.pixels for v in videos)
    if pixels > policy.max_pixels:
        raise BadRequest(FIELD, f"the sampled frames of this request's videos are {pixels} pixels after resizing, "
                                f"more than the limit of {policy.max_pixels} (--max_video_pixels); lower "
                                "mm_processor_kwargs.fps or max_pixels")  # fmt: skip
