"""Request images -> validated image bytes and decoded PIL images.

URL entries are downloaded on the event loop first (`fetch_item`: a fetch that waits holds a socket, not a thread);
decoding and checking are plain synchronous functions the HTTP server runs in a thread pool (`load_images` does both
for a request), so neither blocks its event loop. Every way an input can be wrong raises `BadImage`, whose message
is safe to show the client (the server answers 400).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from concurrent.futures import Executor
from dataclasses import dataclass

import pybase64
from PIL import Image

from mmserve.launch.config import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES_PER_REQUEST
from mmserve.prep.multimodal.url_fetch import FetchPolicy, UrlFetcher, UrlRefused, too_large
from visual.image_decode import BadImage, open_header, open_image

__all__ = [
    "BadImage",
    "ImagePolicy",
    "LoadedImage",
    "decode_base64",
    "fetch_item",
    "is_url",
    "load_image",
    "load_image_bytes",
    "load_images",
    "open_header",
    "open_image",
]


@dataclass(frozen=True)
class ImagePolicy:
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # --max_image_pixels: width * height, checked from the header
    max_images: int = DEFAULT_MAX_IMAGES_PER_REQUEST  # --max_images_per_request
    max_bytes: int = 32 * 1024 * 1024  # encoded size (base64 payloads and downloads)
    fetch: FetchPolicy = FetchPolicy()


@dataclass(frozen=True)
class LoadedImage:
    data: bytes | None  # the image file as sent (what the cache key hashes); None: seen before, not decoded again
    image: Image.Image | None  # fully decoded; None for an image already decoded and checked before
    width: int
    height: int


def decode_base64(text: str, max_bytes: int, what: str = "image") -> bytes:
    """Strict base64 (whitespace and a `data:image/...;base64,` prefix are tolerated). First pybase64 (SIMD): the
    standard library's decoder took ~8 ms of GIL-held time per 896 px PNG, the HTTP process's largest cost per
    image. What it refuses goes through the standard library's, which accepts what it always did (line breaks once
    stripped, and excess "=" padding, which pybase64 refuses) and words the errors."""
    if not isinstance(text, str):
        raise BadImage(f"base64 {what} data must be a string")
    if text.startswith("data:"):
        head, _, text = text.partition(",")
        if not head.endswith(";base64"):
            raise BadImage(f"a data: URL {what} must be base64-encoded")
    if len(text) > (max_bytes + 2) // 3 * 4 + len(text) // 64 + 4:  # room for line breaks, checked again below
        raise BadImage(f"{what} {too_large(what, max_bytes)}")
    try:
        data = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        # Line-wrapped base64 (MIME style): strip the whitespace (copying a multi-MB string only in this case).
        try:
            data = base64.b64decode("".join(text.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise BadImage(f"malformed base64 {what} data: {e}") from None
    if len(data) > max_bytes:
        raise BadImage(f"{what} {too_large(what, max_bytes)}")
    if not data:
        raise BadImage(f"empty {what} data")
    return data


def is_url(item: object) -> bool:
    return isinstance(item, dict) and item.get("type") == "url"


async def fetch_item(item: object, fetcher: UrlFetcher, max_bytes: int, what: str = "image") -> object:
    """A URL entry -> the bytes downloaded (what load_image_bytes then takes as the image or video file); any other
    entry as it is."""
    if not is_url(item):
        return item
    url = item.get("data")
    if not isinstance(url, str) or not url:
        raise BadImage(f'{what} "data" must be a non-empty string')
    try:
        return await fetcher.fetch(url, max_bytes, what)
    except UrlRefused as e:
        raise BadImage(str(e)) from None


def load_image(item: object, policy: ImagePolicy = ImagePolicy()) -> LoadedImage:
    """One `multimodal_params.images` entry, {"type": "base64", "data": str}, or a URL entry's downloaded bytes."""
    data = load_image_bytes(item, policy)
    image = open_image(data, policy.max_pixels)
    return LoadedImage(data, image, image.width, image.height)


def load_image_bytes(item: object, policy: ImagePolicy = ImagePolicy(), what: str = "image") -> bytes:
    """The image file of one entry (bytes: a URL entry's, as fetch_item downloaded them), not decoded yet."""
    if isinstance(item, bytes):
        return item
    if not isinstance(item, dict):
        raise BadImage(f'each {what} must be an object {{"type": "base64" | "url", "data": ...}}')
    kind, payload = item.get("type"), item.get("data")
    if not isinstance(payload, str) or not payload:
        raise BadImage(f'{what} "data" must be a non-empty string')
    if kind == "base64":
        data = decode_base64(payload, policy.max_bytes, what)
    elif kind == "url":
        raise TypeError("a URL entry is downloaded by fetch_item first")
    else:
        raise BadImage(f'unknown {what} type {kind!r}; expected "base64" or "url"')
    return data


async def load_images(
    items: list, policy: ImagePolicy = ImagePolicy(), executor: Executor | None = None
) -> list[LoadedImage]:
    """A request's images, loaded concurrently (URLs on the loop, decoding in `executor`); the first BadImage (in
    order) is raised."""
    if not isinstance(items, list):
        raise BadImage("multimodal_params.images must be a list")
    fetcher = UrlFetcher(policy.fetch)
    loop = asyncio.get_running_loop()

    async def one(item: object) -> LoadedImage:
        item = await fetch_item(item, fetcher, policy.max_bytes)
        return await loop.run_in_executor(executor, load_image, item, policy)

    try:
        results = await asyncio.gather(*(one(item) for item in items), return_exceptions=True)
    finally:
        await fetcher.aclose()
    for index, result in enumerate(results):
        if isinstance(result, BadImage):
            raise BadImage(f"image {index}: {result}")
        if isinstance(result, BaseException):
            raise result
    return results
