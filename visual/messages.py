"""Messages between the HTTP process (the embedding cache's owner) and the visual process.

    HTTP --EncodeJob--> visual --EncodeDone | EncodeFailed--> HTTP
    visual --VisualReady--> parent (once, over the start pipe, after the model loaded)

Small pickled dataclasses: the image bytes travel once (HTTP -> visual, compressed as uploaded); the embeddings
never cross a socket, they are written into the shared-memory segment named after the key.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EncodeJob:
    """Encode one image and store its embeddings under `key` (a new, PENDING cache entry)."""

    key: str
    data: bytes  # the image file's bytes, already validated by the HTTP process


@dataclass(frozen=True)
class EncodeDone:
    key: str
    num_tokens: int  # embedding rows written


@dataclass(frozen=True)
class EncodeFailed:
    key: str
    error: str
    bad_image: bool  # True: the image could not be decoded/preprocessed (a 400); False: an internal error (500)


@dataclass(frozen=True)
class VisualReady:
    """The visual process loaded its model; the HTTP process keys the cache with `cache_salt`."""

    architecture: str
    cache_salt: str
    hidden_size: int
    device: str
    dtype: str


VisualResult = EncodeDone | EncodeFailed
