"""Qwen2-VL's 3-D rotary positions (M-RoPE) for one prompt: temporal, height and width indices per token.

Text tokens advance all three axes together; the tokens of one image or video take (t, row, col) indices on its
merged patch grid, offset by the position reached before it, and the text after it resumes at that offset plus the
grid's largest side (rows or columns, never time: as HF's get_rope_index). A video's temporal index of patch k is
int(k * time_interval): 1 for Qwen2-VL, tokens_per_second * seconds per temporal patch for Qwen2.5-VL (absolute
time). Decode tokens are plain text: index i >= len(prompt) sits at i + delta on all three axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _vision_positions(
    start: int, grid_thw: Sequence[int], spatial_merge_size: int, time_interval: float = 1.0
) -> torch.Tensor:
    """[3, t*h*w] positions of one image's or video's placeholder tokens (row-major over the merged grid)."""
    t, h, w = int(grid_thw[0]), int(grid_thw[1]) // spatial_merge_size, int(grid_thw[2]) // spatial_merge_size
    times = (torch.arange(t) * time_interval).long()  # HF: scaled, then truncated, then offset
    tt, hh, ww = torch.meshgrid(times, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_positions(
    prompt_ids: Sequence[int],
    image_grids_thw: Sequence[Sequence[int]],
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int = 2,
    video_token_id: int | None = None,
    time_intervals: Sequence[float | None] = (),
) -> tuple[torch.Tensor, int]:
    """Positions [3, L] (int64) for prompt_ids, and delta = max position + 1 - L (decode position of token i is
    i + delta). Each run of image_token_id (or video_token_id) must directly follow vision_start_token_id and hold
    exactly its grid's t*h*w/merge^2 tokens; the grids (images and videos) are taken in prompt order, and
    time_intervals (per grid, None for an image; empty: all images) scale the videos' temporal axis."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)
    length = ids.numel()
    parts: list[torch.Tensor] = []
    pos = 0  # next position value
    cursor = 0  # next index into ids
    placeholders = {image_token_id} | ({video_token_id} if video_token_id is not None else set())
    starts = (ids[:-1] == vision_start_token_id).nonzero().flatten() + 1 if length else ids
    vision_starts = [int(i) for i in starts if int(ids[i]) in placeholders]
    if len(vision_starts) != len(image_grids_thw):
        raise ValueError(f"{len(vision_starts)} vision placeholders in the prompt but {len(image_grids_thw)} grids")
    intervals = list(time_intervals) or [None] * len(image_grids_thw)
    for start, grid, interval in zip(vision_starts, image_grids_thw, intervals, strict=True):
        text_len = start - cursor
        parts.append(torch.arange(text_len).expand(3, -1) + pos)
        pos += text_len
        vision = _vision_positions(pos, grid, spatial_merge_size, 1.0 if interval is None else interval)
        end = start + vision.shape[1]
        if end > length or bool((ids[start:end] != ids[start]).any()):
            raise ValueError(f"the image or video at {start} needs {vision.shape[1]} placeholder tokens")
        parts.append(vision)
        pos += max(int(grid[1]), int(grid[2])) // spatial_merge_size
        cursor = end
    parts.append(torch.arange(length - cursor).expand(3, -1) + pos)
    positions = torch.cat(parts, dim=1)  # [3, L]
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta


def mrope_decode_position(token_index: int, delta: int) -> int:
    """The (same on all three axes) position of the token at token_index >= prompt length."""
    return token_index + delta
