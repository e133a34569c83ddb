"""The embedding cache as the HTTP server's event loop uses it: acquire a request's images (sending each image that
is new to the visual process exactly once, and waiting for ones that are already encoding), release them when the
request ends.

    coord = CacheCoordinator(capacity, shm_prefix, send_job=visual_queue.send_nowait)
    entries = await coord.acquire([(key, image_bytes), ...])   # CacheCapacityError -> 400, ImageEncodeError
    ...                                                        # the router reads the embeddings by key
    coord.release(entries)                                     # once the router reads them no more
    coord.on_result(msg)                                       # each EncodeDone/EncodeFailed of the visual process
    coord.encoder_down(reason) / coord.encoder_up()            # the visual process died / is back (supervision)

While the encoder is down, requests whose images are all cached are still served; one with a new image gets
EncoderUnavailable at once, and so does every request waiting on an encoding the dead process had.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from cache.index import CacheBusy, CacheEntry, EmbedCacheIndex, EntryState
from cache.shm_store import segment_name, unlink_segment
from visual.messages import EncodeDone, EncodeFailed, EncodeJob, VisualResult


class ImageEncodeError(Exception):
    def __init__(self, key: str, error: str, bad_image: bool):
        super().__init__(f"image could not be encoded: {error}")
        self.key, self.error, self.bad_image = key, error, bad_image


class EncoderUnavailable(Exception):
    """The visual process is down (restarting): images that are not cached cannot be encoded now."""


class MissingImageData(Exception):
    """acquire() was given no bytes (None) for keys the cache does not hold: the caller must supply them."""

    def __init__(self, keys: list[str]):
        super().__init__(f"no image bytes for {len(keys)} image(s) that are not cached")
        self.keys = keys


class CacheCoordinator:
    def __init__(self, capacity: int, shm_prefix: str, send_job: Callable[[EncodeJob], None]):
        self.shm_prefix = shm_prefix
        self.index = EmbedCacheIndex(capacity, on_evict=lambda key: unlink_segment(segment_name(shm_prefix, key)))
        self._send_job = send_job
        self._pending: dict[str, asyncio.Future] = {}  # key -> resolves when the visual process answers
        self._room = asyncio.Event()  # replaced (after being set) whenever entries may have become free
        self.images_encoded = 0
        self.down_reason: str | None = None  # set while the visual process is down

    async def acquire(
        self,
        images: list[tuple[str, bytes | None]],
        videos: dict[str, dict] | None = None,
        options: dict | None = None,
    ) -> list[CacheEntry]:
        """Hold the cache entries of one request's images (key, bytes), in order, once all are READY. `videos` maps
        the keys that are videos to their sampling parameters; `options` are the request's preprocessing options for
        its images (their keys cover them); each new item's encode job carries what applies to it. Waits while
        the cache has no free room. Bytes may be None for an image the caller expects to be cached already; if it
        is not, MissingImageData is raised before anything changes. Raises CacheCapacityError (too many images for
        the cache), ImageEncodeError or EncoderUnavailable; on any error, or if cancelled, nothing stays held."""
        keys = [key for key, _ in images]
        data = {key: blob for key, blob in images if blob is not None}
        while True:
            missing = [key for key in dict.fromkeys(keys) if key not in data and self.index.lookup(key) is None]
            if missing:
                raise MissingImageData(missing)
            if self.down_reason is not None and any(self.index.lookup(key) is None for key in keys):
                raise EncoderUnavailable(self.down_reason)
            try:
                entries, new = self.index.acquire(keys)
                break
            except CacheBusy:
                await self._room.wait()
        for key in new:
            self._pending[key] = asyncio.get_running_loop().create_future()
            video = (videos or {}).get(key)
            self._send_job(EncodeJob(key, data[key], video, (options or {}) if video is None else {}))
        # Every future now, before the first wait: a result pops its key's future, maybe while we wait on another.
        waits = {e.key: self._pending[e.key] for e in entries if e.state is EntryState.PENDING}
        try:
            for fut in waits.values():
                result = await asyncio.shield(fut)
                if isinstance(result, EncodeFailed):
                    raise ImageEncodeError(result.key, result.error, result.bad_image)
        except BaseException:
            self.release(entries)
            raise
        return entries

    def release(self, entries: list[CacheEntry]) -> None:
        self.index.release(entries)
        self._room_changed()

    def on_result(self, msg: VisualResult) -> None:
        """Apply one answer of the visual process (call it from the task that reads the visual results queue)."""
        if isinstance(msg, EncodeDone):
            self.images_encoded += 1
            if self.index.mark_ready(msg.key, msg.num_tokens) is None:  # dropped meanwhile: nobody will read it
                unlink_segment(segment_name(self.shm_prefix, msg.key))
        else:
            self.index.mark_failed(msg.key)
        fut = self._pending.pop(msg.key, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        self._room_changed()

    def encoder_down(self, reason: str) -> None:
        """The visual process died: what it was encoding is lost. Those entries are dropped (with any segment it
        had begun to write) and their waiters get EncoderUnavailable; new images are refused until encoder_up."""
        self.down_reason = reason
        pending, self._pending = self._pending, {}
        for key, fut in pending.items():
            self.index.mark_failed(key)
            unlink_segment(segment_name(self.shm_prefix, key))
            if not fut.done():
                fut.set_exception(EncoderUnavailable(reason))
                fut.exception()  # retrieved: a waiter that was cancelled meanwhile leaves no "never retrieved" log
        self._room_changed()

    def encoder_up(self) -> None:
        self.down_reason = None

    def metrics(self) -> dict[str, int]:
        return {
            "mmserve_images_encoded_total": self.images_encoded,
            "mmserve_embed_cache_hits_total": self.index.stats.hits,
            "mmserve_embed_cache_items": len(self.index),
            "mmserve_embed_cache_items_in_use": self.index.num_in_use,
        }

    def _room_changed(self) -> None:
        self._room.set()
        self._room = asyncio.Event()
