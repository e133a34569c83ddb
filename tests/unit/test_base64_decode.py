"""The fast strict base64 path against the standard library: the same bytes wherever it applies, and None (the
standard library's turn) wherever the input is not well-formed."""

from __future__ import annotations

import base64
import binascii
import random

import pytest

from mmserve.multimodal.base64_decode import MIN_FAST_CHARS, decode_fast
from mmserve.multimodal.image_io import BadImage, decode_base64


def _stdlib(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


@pytest.mark.parametrize("extra", [0, 1, 2])  # no padding, "xx==" and "xxx=" last groups
def test_equals_the_standard_library_on_well_formed_input(extra):
    rng = random.Random(extra)
    raw = rng.randbytes(MIN_FAST_CHARS // 4 * 3 * 2 + extra)
    text = base64.b64encode(raw).decode()
    assert text.endswith("=" * (3 - extra) if extra else text[-1])
    assert decode_fast(text) == raw
    every_value = base64.b64encode(bytes(range(256)) * 400).decode()  # each character at each position
    assert decode_fast(every_value) == bytes(range(256)) * 400


def test_padding_with_nonzero_spare_bits_decodes_as_the_standard_library_does():
    text = base64.b64encode(bytes(MIN_FAST_CHARS)).decode()[:-4] + "QR=="  # 'R' leaves spare bits set
    assert decode_fast(text) == _stdlib(text)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda t: t[:1000] + "\n" + t[1001:],  # whitespace
        lambda t: t[:1000] + "=" + t[1001:],  # padding inside
        lambda t: t[:1000] + "-" + t[1001:],  # the URL-safe alphabet
        lambda t: t[:1000] + "é" + t[1001:],  # not ASCII
        lambda t: t[:-1],  # not a multiple of 4
        lambda t: t[:-4] + "A===",  # a malformed last group
        lambda t: t[:-4] + "=AAA",
    ],
)
def test_malformed_input_is_left_to_the_standard_library(corrupt):
    text = corrupt(base64.b64encode(bytes(range(256)) * 400).decode())
    assert decode_fast(text) is None
    assert _stdlib(text) is None  # and the standard library rejects it as well


def test_short_input_is_left_to_the_standard_library():
    assert decode_fast(base64.b64encode(b"x" * 300).decode()) is None


def test_decode_base64_gives_the_same_bytes_and_errors_either_way():
    raw = random.Random(7).randbytes(MIN_FAST_CHARS)
    text = base64.b64encode(raw).decode()
    assert decode_base64(text, 1 << 30) == raw
    wrapped = "\n".join(text[i : i + 76] for i in range(0, len(text), 76))  # MIME line breaks: the slow path
    assert decode_base64(wrapped, 1 << 30) == raw
    with pytest.raises(BadImage, match="malformed base64"):
        decode_base64(text[:-4] + "A===", 1 << 30)
