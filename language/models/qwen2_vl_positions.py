"""Qwen2-VL's 3-D rotary positions (M-RoPE) for one prompt: temporal, height and width indices per token.

Text tokens advance all three axes together; the tokens of one image take (t, row, col) indices on its merged patch
grid, offset by the position reached before it, and the text after the image resumes at that offset plus the grid's
largest side. Decode tokens are plain text: index i >= len(prompt) sits at i + delta on all three axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _image_positions(start: int, grid_thw: Sequence[int], spatial_merge_size: int) -> torch.Tensor:
    """[3, t*h*w] positions of one image's placeholder tokens (row-major over the merged grid)."""
    t, h, w = int(grid_thw[0]), int(grid_thw[1]) // spatial_merge_size, int(grid_thw[2]) // spatial_merge_size
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_positions(
    prompt_ids: Sequence[int],
    image_grids_thw: Sequence[Sequence[int]],
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int = 2,
) -> tuple[torch.Tensor, int]:
    """Positions [3, L] (int64) for prompt_ids, and delta = max position + 1 - L (decode position of token i is
    i + delta). Each run of image_token_id must directly follow vision_start_token_id and hold exactly its grid's
    t*h*w/merge^2 tokens; the grids are taken in prompt order."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)
    length = ids.numel()
    parts: list[torch.Tensor] = []
    pos = 0  # next position value
    cursor = 0  # next index into ids
    starts = (ids[:-1] == vision_start_token_id).nonzero().flatten() + 1 if length else ids
    image_starts = [int(i) for i in starts if ids[i] == image_token_id]
    if len(image_starts) != len(image_grids_thw):
        raise ValueError(f"{len(image_starts)} image placeholders in the prompt but {len(image_grids_thw)} grids")
    for start, grid in zip(image_starts, image_grids_thw, strict=True):
        text_len = start - cursor
        parts.append(torch.arange(text_len).expand(3, -1) + pos)
        pos += text_len
        image = _image_positions(pos, grid, spatial_merge_size)
        end = start + image.shape[1]
        if end > length or bool((ids[start:end] != image_token_id).any()):
            raise ValueError(f"image at {start} needs {image.shape[1]} placeholder tokens")
        parts.append(image)
        pos += max(int(grid[1]), int(grid[2])) // spatial_merge_size
        cursor = end
    parts.append(torch.arange(length - cursor).expand(3, -1) + pos)
    positions = torch.cat(parts, dim=1)  # [3, L]
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta


def mrope_decode_position(token_index: int, delta: int) -> int:
    """The (same on all three axes) position of the token at token_index >= prompt length."""
    return token_index + delta
