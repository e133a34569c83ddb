"""Random test pictures and their wire form, shared by the end-to-end tests."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A seeded RGB noise picture (nothing compresses it, so every image is its own cache entry)."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_b64(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")  # lossless: the server decodes exactly the pixels HF sees
    return base64.b64encode(buf.getvalue()).decode()
