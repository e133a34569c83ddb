"""Messages between the HTTP process (the embedding cache's owner) and the visual process.

    HTTP --EncodeJob--> visual --EncodeDone | EncodeFailed--> HTTP
    visual --VisualReady--> parent (once, over the start pipe, after the model loaded)

Small pickled dataclasses, but for EncodeJob: two frames, its key and the image bytes, sent without a copy (pickling
a 2.4 MB PNG and handing it to zmq copied it twice, ~5 ms of the HTTP process per 896 px image). The image bytes
travel once (HTTP -> visual, compressed as uploaded); the embeddings never cross a socket, they are written into the
shared-memory segment named after the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class EncodeJob:
    """Encode one image or video and store its embeddings under `key` (a new, PENDING cache entry)."""

    key: str
    data: bytes  # the image or video file's bytes, already checked by the HTTP process
    video: dict | None = None  # a video's effective sampling parameters (JSON values); None: an image

    def frames(self) -> list[bytes]:
        """The job as zmq frames: [key, data] or [key, data, video sampling as JSON] (send_multipart with copy=False
        sends `data` in place)."""
        head = [self.key.encode(), self.data]
        return head if self.video is None else head + [json.dumps(self.video).encode()]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> EncodeJob:
        """The job `frames` made; ValueError for anything else."""
        if len(frames) not in (2, 3):
            raise ValueError(f"an EncodeJob is 2 or 3 frames, got {len(frames)}")
        video = json.loads(bytes(frames[2])) if len(frames) == 3 else None
        if video is not None and not isinstance(video, dict):
            raise ValueError("an EncodeJob's video sampling is a JSON object")
        return cls(bytes(frames[0]).decode(), bytes(frames[1]), video)


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
