"""Messages between the HTTP process (the embedding cache's owner) and the visual process.

    HTTP --EncodeJob--> visual --EncodeDone | EncodeFailed--> HTTP
    visual --VisualReady--> parent (once, over the start pipe, after the model loaded)

Small pickled dataclasses, but for EncodeJob: two frames, its key and the image bytes, sent without a copy (pickling
a 2.4 MB PNG and handing it to zmq copied it twice, ~5 ms of the HTTP process per 896 px image). The image bytes
travel once (HTTP -> visual, compressed as uploaded); the embeddings never cross a socket, they are written into the
shared-memory segment named after the key.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EncodeJob:
    """Encode one image and store its embeddings under `key` (a new, PENDING cache entry)."""

    key: str
    data: bytes  # the image file's bytes, already validated by the HTTP process

    def frames(self) -> list[bytes]:
        """The job as zmq frames: [key, data] (send_multipart with copy=False sends `data` in place)."""
        return [self.key.encode(), self.data]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> EncodeJob:
        """The job `frames` made; ValueError for anything else."""
        if len(frames) != 2:
            raise ValueError(f"an EncodeJob is 2 frames, got {len(frames)}")
        return cls(bytes(frames[0]).decode(), bytes(frames[1]))


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
