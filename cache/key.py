"""Cache keys: a 128-bit xxh3 of the image bytes plus everything else that changes the embedding."""

from __future__ import annotations

import xxhash


def cache_key(image_bytes: bytes, salt: str) -> str:
    """32 hex digits. `salt` is the vision model's `cache_salt` (model identity and preprocessing settings), so one
    image under two models or processors gets two entries."""
    h = xxhash.xxh3_128()
    h.update(image_bytes)
    h.update(b"\x00salt:" + salt.encode())
    return h.hexdigest()
