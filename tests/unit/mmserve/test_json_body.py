"""mmserve.http.json_body.loads: what json.loads gives and raises, for bodies with long strings cut out and put back."""

from __future__ import annotations

import base64
import json
import os

import pytest

from mmserve.http import json_body
from mmserve.prep.multimodal.image_io import BadImage, decode_base64

LONG = json_body._LONG


def b64(n: int, seed: int = 0) -> str:
    return base64.b64encode(os.urandom(n * 3 // 4) if seed else bytes(range(256)) * (n // 341 + 1))[:n].decode()


VALID = [
    {"inputs": "x", "multimodal_params": {"images": [{"type": "base64", "data": b64(3 * LONG)}]}},
    {"inputs": "é" * LONG, "parameters": {"max_new_tokens": 3}},  # multi-byte UTF-8 in a long string
    {"inputs": "q", "images": [{"data": b64(LONG)}, {"data": b64(LONG - 1)}, {"data": b64(2 * LONG, seed=1)}]},
    {b64(LONG): [1, 2.5, None, True, {"k": "v"}]},  # a long key
    {"messages": [{"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(LONG)}}]}]},
    {"inputs": 'a "quoted" \\ back\\slash \n newline ' + "z" * LONG, "other": "y" * LONG},  # escapes: kept whole
    [b64(LONG), "\\", '"', b64(LONG) + '\\"'],
]


@pytest.mark.parametrize("doc", VALID, ids=range(len(VALID)))
@pytest.mark.parametrize(
    "dumps", [json.dumps, lambda d: json.dumps(d, ensure_ascii=False, indent=1)], ids=["ascii", "utf8"]
)
def test_equals_json_loads(doc, dumps):
    raw = dumps(doc).encode()
    assert json_body.loads(raw) == json.loads(raw) == doc


def test_long_strings_are_cut_out():
    raw = json.dumps(VALID[0]).encode()
    assert [end - start for start, end in json_body._long_plain_strings(raw)] == [3 * LONG]
    raw = json.dumps(VALID[5]).encode()
    assert [end - start for start, end in json_body._long_plain_strings(raw)] == [LONG]  # not the escaped one


def _error(raw: bytes) -> str:
    try:
        json.loads(raw)
    except ValueError as e:
        return str(e)
    raise AssertionError("json.loads accepted it")


INVALID = [
    b'{"inputs": "' + b"a" * LONG + b'\x01b"}',  # a control character in a long string that is not an image
    b'{"inputs": "' + b"a" * LONG + b'\xff"}',  # not UTF-8
    b'{"' + b"k\x1f" * LONG + b'": 1}',  # a control character in a long key
    b'{"inputs": "' + b"a" * LONG,  # unterminated
    b'{"inputs": "' + b"a" * LONG + b'"} trailing',
    b'{"inputs": "' + b"a" * LONG + b'" "b"}',
    json.dumps({"inputs": "a" * LONG}).encode("utf-16"),  # json.loads reads it; so must we
]


@pytest.mark.parametrize("raw", INVALID, ids=range(len(INVALID)))
def test_errors_as_json_loads(raw):
    try:
        expected = json.loads(raw)
    except ValueError:
        with pytest.raises(ValueError) as info:
            json_body.loads(raw)
        assert str(info.value) == _error(raw)
    else:
        assert json_body.loads(raw) == expected


def test_an_image_payload_is_left_to_base64_to_check():
    """A control character inside an image payload: base64 decoding refuses it (400 either way)."""
    raw = b'{"images": [{"type": "base64", "data": "' + b"QUJD" * (LONG // 4) + b'\x01"}]}'
    with pytest.raises(ValueError):
        json.loads(raw)
    data = json_body.loads(raw)["images"][0]["data"]
    with pytest.raises(BadImage, match="malformed base64"):
        decode_base64(data, max_bytes=1 << 30)


def nested(depth: int) -> bytes:
    """An object whose parameters nest `depth` arrays and objects deep in all (the body itself counted)."""
    inner = depth - 2  # the body and "parameters"
    return b'{"inputs": "hi", "parameters": {"x": ' + b"[" * inner + b"1" + b"]" * inner + b"}}"


def test_bodies_nested_past_the_limit_get_a_400_whatever_json_loads_allows():
    """json.loads takes a 257-deep body on every Python; its own limit (~1000 on 3.11, ~3000+ on 3.13) is not the
    server's."""
    from mmserve.http.protocol import BadRequest, parse_json

    assert parse_json(nested(json_body.MAX_DEPTH))["inputs"] == "hi"
    json.loads(nested(json_body.MAX_DEPTH + 1))
    with pytest.raises(BadRequest, match="nested too deeply"):
        parse_json(nested(json_body.MAX_DEPTH + 1))
    with pytest.raises(BadRequest, match="nested too deeply"):
        parse_json(b"[" * 100_000 + b"]" * 100_000)  # past json.loads's own limit: the same answer


def test_wide_bodies_are_not_too_deep():
    wide = json.dumps({"inputs": "hi", "ids": [[i] for i in range(5000)], "m": [{"a": {"b": [1]}}] * 500}).encode()
    assert not json_body.too_deep(json.loads(wide))
