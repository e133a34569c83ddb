"""Messages between the HTTP process (the embedding cache's owner) and the visual process.

    HTTP --EncodeJob--> visual --EncodeDone | EncodeFailed--> HTTP
    visual --VisualReady--> parent (once, over the start pipe, after the model loaded)

Small pickled dataclasses, but for EncodeJob: two frames, its key and the file's bytes, sent without a copy (pickling
a 2.4 MB PNG and handing it to zmq copied it twice, ~5 ms of the HTTP process per 896 px image), and a third, a JSON
object, when the item has preprocessing parameters: {"video": {...}} (a video's sampling) and/or {"options": {...}}
(the request's preprocessor keyword arguments, e.g. InternVL's tile cap). The bytes travel once (HTTP -> visual,
compressed as uploaded); the embeddings never cross a socket, they are written into the shared-memory segment named
after the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EncodeJob:
    """Encode one image or video and store its embeddings under `key` (a new, PENDING cache entry). `video` and
    `options` change what the preprocessing makes, so the HTTP process's `key` covers them (with the bytes)."""

    key: str
    data: bytes  # the image or video file's bytes, already checked by the HTTP process
    video: dict | None = None  # a video's effective sampling parameters (JSON values); None: an image
    options: dict = field(default_factory=dict)  # the preprocessor's keyword arguments (e.g. {"max_patches": 6})

    def frames(self) -> list[bytes]:
        """The job as zmq frames: [key, data] or [key, data, params as JSON] (send_multipart with copy=False sends
        `data` in place)."""
        head = [self.key.encode(), self.data]
        params = self._params()
        return head + [json.dumps(params).encode()] if params else head

    def _params(self) -> dict[str, dict]:
        params = {}
        if self.video is not None:
            params["video"] = self.video
        if self.options:
            params["options"] = self.options
        return params

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> EncodeJob:
        """The job `frames` made; ValueError for anything else."""
        if len(frames) not in (2, 3):
            raise ValueError(f"an EncodeJob is 2 or 3 frames, got {len(frames)}")
        params = json.loads(bytes(frames[2])) if len(frames) == 3 else {}
        if not isinstance(params, dict) or not set(params) <= {"video", "options"}:
            raise ValueError("an EncodeJob's third frame is a JSON object of 'video' and 'options'")
        video, options = params.get("video"), params.get("options", {})
        if not (video is None or isinstance(video, dict)) or not isinstance(options, dict):
            raise ValueError("an EncodeJob's video sampling and options are JSON objects")
        return cls(bytes(frames[0]).decode(), bytes(frames[1]), video, options)


@dataclass(frozen=True)
class EncodeDone:
    key: str
    num_tokens: int  # embedding rows written
    # where its time went, for the HTTP process's metrics: the preprocessing worker's (decode, sampling, the
    # processor) and its share of its batch's tower time (by tower rows); video: a video, not an image
    preprocess_s: float = 0.0
    tower_s: float = 0.0
    video: bool = False


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
