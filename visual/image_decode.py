"""Decoding image files, shared by the HTTP process (which validates every image it accepts) and the visual
process's preprocessing workers. It lives in `visual/` so that both sides import it along the package flow
(`mmserve` -> `cache` -> `visual`).

Abuse it stops before decoding a pixel:
- decompression bombs: the size the header declares is checked against the pixel cap (`--max_image_pixels`) right
  after `Image.open`, which reads headers only; PIL's own bomb guard (2 x `Image.MAX_IMAGE_PIXELS`) answers first
  for absurd sizes and gets the same message;
- formats whose decoded size need not match their header, or that run outside code: only the raster formats in
  `FORMATS` are opened (not ICO/ICNS/CUR, whose entries embed PNGs of any size, nor EPS, which runs Ghostscript,
  nor the scientific and game formats PIL also reads). The size is checked again after decoding.
Multi-frame files (GIF, APNG, TIFF, WebP, MPO) decode frame 0 only: `Image.open` stands on frame 0 and nothing here
seeks, which is also what HF's processors see when handed the opened file.
"""

from __future__ import annotations

import io
import re

from PIL import Image


class BadImage(ValueError):
    """An image input that cannot be used; the message says why (shown to the client)."""


# The formats accepted (PIL format names); MPO is how PIL names many camera JPEGs (multi-picture).
FORMATS = ("PNG", "JPEG", "MPO", "GIF", "WEBP", "BMP", "DIB", "TIFF", "PPM", "TGA", "AVIF")
_OPENERS = [f for f in FORMATS if f != "MPO"]  # the JPEG opener answers MPO files
PIXELS_FLAG = "--max_image_pixels"


def _over_cap(width: int, height: int, max_pixels: int, limit_name: str) -> BadImage:
    return BadImage(
        f"image is {width}x{height} = {width * height} pixels, more than the limit of {max_pixels} ({limit_name})"
    )


_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>")


def _reason(e: Exception) -> str:
    """PIL's reason, for the client: without the repr of our buffer it names ("cannot identify image file
    <_io.BytesIO object at 0x...>"), and nothing when that was all it said."""
    if isinstance(e, Image.UnidentifiedImageError):
        return ""
    text = _OBJECT_REPR.sub("", str(e)).strip()
    return f": {text}" if text else ""


def open_header(data: bytes, max_pixels: int, limit_name: str = PIXELS_FLAG) -> Image.Image:
    """Open `data` and check what its header declares (format, size against max_pixels) without decoding a pixel.
    The HTTP side needs no more (the size sets the prompt's token count); the visual process decodes it fully with
    `open_image`, which also checks that the decoded size is the declared one. `limit_name` names the cap in the
    message (the server flag that sets it)."""
    # No warnings.catch_warnings() here: it swaps process-wide state, and this runs in many threads at once. PIL's
    # DecompressionBombWarning (above MAX_IMAGE_PIXELS) is only a warning; our own cap below decides.
    try:
        image = Image.open(io.BytesIO(data), formats=_OPENERS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # PIL's guard (or -W error)
        declared = re.search(r"\((\d+) pixels\)", str(e))
        size = f"{declared.group(1)} pixels" if declared else "more pixels than PIL decodes"
        raise BadImage(f"image declares {size}, more than the limit of {max_pixels} ({limit_name})") from None
    except Exception as e:  # PIL raises many types (UnidentifiedImageError, SyntaxError, struct.error, ...)
        raise BadImage(f"data is not a readable image (accepted formats: {', '.join(FORMATS)}){_reason(e)}") from None
    if image.format not in FORMATS:  # a plugin answering for another format's bytes
        raise BadImage(f"unsupported image format {image.format}; accepted: {', '.join(FORMATS)}")
    width, height = image.size
    if width < 1 or height < 1:
        raise BadImage(f"image has an empty size {width}x{height}")
    if width * height > max_pixels:
        raise _over_cap(width, height, max_pixels, limit_name)
    return image


def open_image(data: bytes, max_pixels: int, limit_name: str = PIXELS_FLAG) -> Image.Image:
    """Decode frame 0 of `data` completely, after `open_header`'s checks (a bomb is refused before any pixel is
    decoded)."""
    image = open_header(data, max_pixels, limit_name)
    declared = image.size
    try:
        image.load()  # frame 0
    except Exception as e:
        raise BadImage(f"image data is truncated or corrupt: {e}") from None
    if image.size != declared:  # a decoder that changed the size: the prompt was expanded for the header's
        width, height = declared
        raise BadImage(f"image decodes to {image.width}x{image.height}, not the {width}x{height} it declares")
    return image
