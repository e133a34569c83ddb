"""Request bodies as JSON, quickly when they carry images: `loads(raw)` gives what `json.loads(raw)` gives, and
raises what it raises, and refuses a body nested past MAX_DEPTH levels (TooDeep) on every Python version.

An 896 px PNG in base64 is a 3.2 MB JSON string, and `json.loads` builds it character by character: ~3 ms per
body, a third of the HTTP process's CPU under a burst of such requests (py-spy on the GPU host). JSON's strings are
found by their quotes alone (outside a string a quote opens one; inside, an unescaped quote closes it), so long
strings without escapes are located with memchr-speed searches, cut out, and the small rest goes to `json.loads`
with a placeholder in each one's place; the strings are put back, decoded as UTF-8, in the parsed result.

What `json.loads` would also check in such a string is that it has no control characters. That is checked here
too, except for an image payload (`"data"`, or a `"url"` holding a data: URL): base64 decoding rejects those
characters anyway, and a payload recognised by the hash of its text matches only a text that was decoded before.
"""

from __future__ import annotations

import json
import secrets

_LONG = 64 * 1024  # strings at least this long are cut out
_QUOTE, _BACKSLASH = b'"', b"\\"
_CONTROL = bytes(1 if c < 0x20 else 0 for c in range(256))  # translate table: 1 marks a control character


def loads(raw: bytes) -> object:
    """What json.loads(raw) gives, or raises; TooDeep past MAX_DEPTH levels of arrays and objects."""
    spans = _long_plain_strings(raw) if len(raw) >= _LONG and json.detect_encoding(raw) == "utf-8" else []
    if not spans:
        return _not_too_deep(json.loads(raw), raw)
    nonce = secrets.token_hex(8)  # no client can guess a placeholder
    pieces, cut, pos = [], {}, 0
    for i, (start, end) in enumerate(spans):  # raw[start:end]: a string's content, between its quotes
        name = f"{nonce}:{i}"
        pieces += [raw[pos:start], b"\\u0000", name.encode()]
        cut["\x00" + name] = (start, end)
        pos = end
    pieces.append(raw[pos:])
    structure = b"".join(pieces)
    try:
        parsed = _Restore(raw, cut).value(json.loads(structure), key=None)
    except (ValueError, _Invalid):
        return json.loads(raw)  # the document is invalid: json.loads's own error for it (positions and all)
    return _not_too_deep(parsed, structure)


class _Invalid(Exception):
    """A cut string json.loads would reject (not UTF-8, or a control character where one is checked)."""


class _Restore:
    def __init__(self, raw: bytes, cut: dict[str, tuple[int, int]]) -> None:
        self.raw, self.cut = raw, cut

    def value(self, obj: object, key: str | None) -> object:
        if isinstance(obj, str):
            return self.string(obj, key)
        if isinstance(obj, dict):
            return {self.string(k, None): self.value(v, k) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.value(v, key) for v in obj]
        return obj

    def string(self, s: str, key: str | None) -> str:
        span = self.cut.get(s) if s.startswith("\x00") else None
        if span is None:
            return s
        start, end = span
        try:
            text = str(memoryview(self.raw)[start:end], "utf-8")  # decoded in place: no copy of the bytes first
        except UnicodeDecodeError:
            raise _Invalid from None
        is_image = key == "data" or (key == "url" and text.startswith("data:"))
        if not is_image and self.raw[start:end].translate(_CONTROL).find(1) != -1:
            raise _Invalid
        return text


def _long_plain_strings(raw: bytes) -> list[tuple[int, int]]:
    """(start, end) of the content of every string of at least _LONG bytes without a backslash, in order; [] when
    the quotes do not pair up (json.loads then reports the document as it is)."""
    spans = []
    opening = raw.find(_QUOTE)
    while opening != -1:
        closing = raw.find(_QUOTE, opening + 1)
        while closing != -1 and _is_escaped(raw, closing):
            closing = raw.find(_QUOTE, closing + 1)
        if closing == -1:
            return []
        start = opening + 1
        if closing - start >= _LONG and raw.find(_BACKSLASH, start, closing) == -1:
            spans.append((start, closing))
        opening = raw.find(_QUOTE, closing + 1)
    return spans


def _is_escaped(raw: bytes, quote: int) -> bool:
    """An odd run of backslashes right before raw[quote]."""
    run = 0
    while quote - run - 1 >= 0 and raw[quote - run - 1] == 0x5C:
        run += 1
    return run % 2 == 1


# The deepest nesting of arrays and objects a body may have. json.loads's own limit moves with the Python version (a
# 3000-deep body fails on 3.11 and parses on 3.13) and with the caller's stack; this one does not, and it keeps deep
# values away from the recursive code a body goes through afterwards (chat templates, schema compilers, copies).
MAX_DEPTH = 256


class TooDeep(ValueError):
    """A body nested past MAX_DEPTH."""


def _not_too_deep(obj: object, parsed: bytes) -> object:
    """`obj`, unless it nests arrays and objects past MAX_DEPTH. Only a body with more opening brackets than that
    (in the bytes json.loads read: an image payload cut out is not read) can, so almost none is walked."""
    if parsed.count(b"[") + parsed.count(b"{") > MAX_DEPTH and too_deep(obj):
        raise TooDeep(f"nested more than {MAX_DEPTH} levels deep")
    return obj


def too_deep(obj: object) -> bool:
    """Whether `obj` nests arrays and objects more than MAX_DEPTH deep (walked without recursion)."""
    stack: list[tuple[object, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > MAX_DEPTH:
                    return True
                stack.append((child, depth + 1))
    return False


def lone_surrogate(obj: object, raw: bytes) -> tuple[str, str] | None:
    """(where, the string shown with its surrogates escaped) of the first string or key holding a lone surrogate,
    else None. JSON lets "\\ud800" through (and json.loads decodes raw bytes with surrogatepass), but such a string
    is not Unicode text: a tokenizer raises on it and it cannot be encoded into an answer. Only an escape or an
    0xED byte makes one, so a body without either (every base64 image body) is not walked at all."""
    if b"\\u" not in raw and b"\xed" not in raw:
        return None
    stack: list[tuple[object, str]] = [(obj, "")]
    while stack:  # iterative: the body may be nested as deep as json.loads allows
        value, where = stack.pop()
        if isinstance(value, str):
            if _has_lone_surrogate(value):
                return where or "body", shown(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                path = f"{where}.{shown(key)}" if where else shown(key)
                if _has_lone_surrogate(key):
                    return path, shown(key)
                stack.append((item, path))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(value))
    return None


def shown(text: str) -> str:
    """`text` with lone surrogates as \\udxxx escapes: safe to put in an answer."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
