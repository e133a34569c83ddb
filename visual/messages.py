"""Messages between the HTTP process (the embedding cache's owner) and the visual process.

    HTTP --EncodeJob--> visual --EncodeDone | EncodeFailed--> HTTP
    visual --VisualReady--> parent (once, over the start pipe, after the model loaded)

Small pickled dataclasses, but for EncodeJob: two frames, its key and the image bytes, sent without a copy (pickling
a 2.4 MB PNG and handing it to zmq copied it twice, ~5 ms of the HTTP process per 896 px image), and a third, JSON,
for a request's preprocessing options when it has any (InternVL's tile cap). The image bytes
travel once (HTTP -> visual, compressed as uploaded); the embeddings never cross a socket, they are written into the
shared-memory segment named after the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EncodeJob:
    """Encode one image and store its embeddings under `key` (a new, PENDING cache entry)."""

    key: str
    data: bytes  # the image file's bytes, already validated by the HTTP process
    # keyword arguments of the family's preprocessor for this request (e.g. {"max_patches": 6}); part of `key`
    options: dict = field(default_factory=dict)

    def frames(self) -> list[bytes]:
        """The job as zmq frames: [key, data] or [key, data, options as JSON] (send_multipart with copy=False sends
        `data` in place)."""
        head = [self.key.encode(), self.data]
        return head + [json.dumps(self.options).encode()] if self.options else head

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> EncodeJob:
        """The job `frames` made; ValueError for anything else."""
        if len(frames) not in (2, 3):
            raise ValueError(f"an EncodeJob is 2 or 3 frames, got {len(frames)}")
        options = json.loads(bytes(frames[2])) if len(frames) == 3 else {}
        if not isinstance(options, dict):
            raise ValueError("an EncodeJob's options are a JSON object")
        return cls(bytes(frames[0]).decode(), bytes(frames[1]), options)


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
