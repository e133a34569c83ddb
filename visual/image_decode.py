"""Decoding image files, shared by the HTTP process (which validates every image it accepts) and the visual
process's preprocessing workers. It lives in `visual/` so that both sides import it along the package flow
(`mmserve` -> `cache` -> `visual`)."""

from __future__ import annotations

import io
import warnings

from PIL import Image


class BadImage(ValueError):
    """An image input that cannot be used; the message says why (shown to the client)."""


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Decode `data` completely. The size in the header is checked against max_pixels before any pixel is decoded
    (a small file can declare a huge image); truncated files fail here rather than later in the visual process."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise BadImage(f"image has more than {max_pixels} pixels") from None
    except Exception as e:  # PIL raises many types (UnidentifiedImageError, SyntaxError, struct.error, ...)
        raise BadImage(f"data is not a readable image: {e}") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise BadImage(f"image has an empty size {width}x{height}")
    if width * height > max_pixels:
        raise BadImage(f"image is {width}x{height} = {width * height} pixels, more than the limit of {max_pixels}")
    try:
        image.load()
    except Exception as e:
        raise BadImage(f"image data is truncated or corrupt: {e}") from None
    return image
