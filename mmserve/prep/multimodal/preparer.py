"""The HTTP process's image support, as one object the request preparer calls (`prep.tokenization.ImagePreparer`):
load and check the request's images, expand the prompt, hold the images' cache entries until they are encoded, and
release them when the request ends.

    preparer = MultimodalPreparer(prompt_processor, coordinator, cache_salt, ImagePolicy(...), image_executor)
    prepared = await preparer.prepare(rid, MultimodalInput(prompt, multimodal_params), run_sync)  # or BadRequest
    preparer.release(rid)                                                          # finished / aborted / failed

The request reaches the router only after its images are in the cache, with one exception: with `defer` (the
prefix cache is on for the request), an image seen before but evicted from the embedding cache since is not encoded
at once. Its ImageRef says `embedded=False`, and the router first tries the request on the prefix cache: when that
holds the KV of the whole prompt up to past the image (a follow-up turn), the image is never encoded. Otherwise the
router asks for it (`encode_deferred`), and the request goes on once it is in the cache.

Latency: each image is decoded, checked and hashed in one call on `image_executor` (threads: PNG/JPEG decoding and
xxhash release the GIL, so they scale with cores; the tokenizer pool stays free for prompts), and each new image's
EncodeJob leaves before the prompt is tokenized, so tokenizing overlaps the encoding. With DEBUG logging on, one
`image request timing:` line per request gives the stages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import xxhash

from cache.coordinator import CacheCoordinator, EncoderUnavailable, ImageEncodeError, MissingImageData
from cache.index import CacheCapacityError, CacheEntry
from cache.key import cache_key
from mmserve.http.protocol import BadRequest, ServerFailure
from mmserve.ipc.messages import ImageRef
from mmserve.prep.multimodal.image_io import (
    BadImage,
    ImagePolicy,
    LoadedImage,
    fetch_item,
    load_image_bytes,
    open_header,
)
from mmserve.prep.multimodal.prompt import MultimodalPrompt, PromptImageMismatch, PromptProcessor
from mmserve.prep.multimodal.url_fetch import UrlFetcher
from mmserve.prep.multimodal.video_io import FIELD as VIDEO_FIELD
from mmserve.prep.multimodal.video_io import (
    LoadedVideo,
    VideoPolicy,
    check_request_totals,
    load_video,
    request_sampling,
)
from mmserve.prep.tokenization import MultimodalInput, PreparedPrompt, RunSync

FIELD = "multimodal_params.images"
logger = logging.getLogger(__name__)
SizeCheck = Callable[[int, int], None]  # (width, height) -> None, or BadImage: a size the family cannot take


@dataclass(frozen=True)
class JobParams:
    """What one request's encode jobs carry beside the bytes (visual/messages.py's EncodeJob), each covered by its
    item's cache key: the sampling parameters of its videos (by key: video_io.video_key hashes them with the bytes)
    and the preprocessing options of its images (load_and_key's salt ends with them)."""

    videos: dict[str, dict] = field(default_factory=dict)
    options: dict = field(default_factory=dict)


class SeenImages:
    """Images already decoded and checked: (cache key, width, height) by cache key and by a fingerprint of the
    base64 text they came in. The same image again (a follow-up turn, another question about one picture) then
    costs a hash of its text: no base64 decoding and no image decoding, which hold the GIL for ~10 ms per 896 px
    PNG and were most of the HTTP side's time under such loads. Bounded: it forgets everything when full. Used
    from the image threads (single dict operations are atomic)."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._seen: dict[str, tuple[str, int, int]] = {}

    def get(self, name: str) -> tuple[str, int, int] | None:
        return self._seen.get(name)

    def add(self, names: list[str], value: tuple[str, int, int]) -> None:
        if len(self._seen) + len(names) > self.capacity:
            self._seen = {}
        for name in names:
            self._seen[name] = value


def _fingerprint(item: object, variant: str = "") -> str | None:
    """A name for a base64 entry's text under the request's preprocessing options `variant` (None for other
    entries)."""
    if isinstance(item, dict) and item.get("type") == "base64" and isinstance(item.get("data"), str):
        return "b64:" + xxhash.xxh3_128_hexdigest(item["data"].encode("utf-8", "surrogatepass")) + variant
    return None


def load_and_key(
    item: object,
    policy: ImagePolicy,
    salt: str,
    seen: SeenImages | None = None,
    check_size: SizeCheck | None = None,
    variant: str = "",
):
    """One image entry (a URL entry already downloaded: its bytes) -> (the checked image, its cache key), in one
    thread-pool hop; `variant` names the request's preprocessing options, which `salt` ends with. An image seen
    before comes back without its bytes (data None): the cache is expected to hold it (see
    MultimodalPreparer._acquire)."""
    fingerprint = _fingerprint(item, variant) if seen is not None else None
    hit = seen.get(fingerprint) if fingerprint is not None else None
    if hit is not None:
        key, width, height = hit
        return LoadedImage(None, None, width, height), key
    data = load_image_bytes(item, policy)
    key = cache_key(data, salt)
    hit = seen.get(key) if seen is not None else None
    if hit is not None:  # the same bytes sent another way (URL, data: URL)
        width, height = hit[1], hit[2]
    else:
        # The header is all the prompt needs; the visual process decodes the pixels (a corrupt file fails there,
        # as a 400 all the same). Decoding here too would hold the GIL for ~15 ms per 896 px PNG and slow a burst
        # of new images on their way to the vision tower.
        width, height = open_header(data, policy.max_pixels).size
        if check_size is not None:
            check_size(width, height)
    if seen is not None:
        seen.add([key] + ([fingerprint] if fingerprint else []), (key, width, height))
    return LoadedImage(data, None, width, height), key


class MultimodalPreparer:
    def __init__(self, prompt_processor: PromptProcessor, coordinator: CacheCoordinator, cache_salt: str,
                 policy: ImagePolicy | None = None, image_executor: Executor | None = None, *,
                 check_size: SizeCheck | None = None, images_in_prompt: bool = False, videos: bool = False,
                 video_policy: VideoPolicy | None = None, encode_tiled: Callable | None = None):  # fmt: skip
        """check_size, images_in_prompt, videos, encode_tiled: the prompt processor's optional capabilities its family
        declares (families/spec.py), e.g. Qwen2-VL's aspect-ratio bound checked from each image's header before
        anything is sent or tokenized, Qwen-VL's images named inside the prompt, video input (video_io.py), and
        InternVL's per-request tile cap (`encode_tiled(prompt, sizes, max_patches)`: a request's cap goes to the
        prompt, the images' cache keys and the visual process's preprocessor)."""
        self.prompt_processor = prompt_processor
        self.image_executor = image_executor  # None: the event loop's default executor
        self.coordinator = coordinator
        self.cache_salt = cache_salt
        self.policy = policy or ImagePolicy()
        self.fetcher = UrlFetcher(self.policy.fetch)
        self._check_size = check_size
        self._images_in_prompt = images_in_prompt
        self._videos = videos
        self.video_policy = video_policy or VideoPolicy()
        self._encode_tiled = encode_tiled
        if images_in_prompt:  # Qwen-VL reads allowed paths itself: the same size limit
            prompt_processor.max_image_bytes = self.policy.max_bytes
        self._held: dict[str, list[CacheEntry]] = {}  # rid -> its cache entries
        self._seen = SeenImages()
        # rid -> (its image entries, keys, bytes so far, the keys deferred, its job parameters): images not encoded
        # unless the router asks (see the module's docstring)
        self._deferred: dict[str, tuple[list, list[str], list[bytes | None], set[str], JobParams]] = {}
        self.encodes_skipped = 0  # deferred images the router never asked for: their KV was in the prefix cache
        self._encoding: set[str] = set()  # rids in encode_deferred (release drops them: it must not hold after)

    async def prepare(self, rid: str, request: MultimodalInput, run_sync: RunSync) -> PreparedPrompt:
        """`request.max_patches` >= 0: the request's tile cap, for a family that tiles images (others ignore it)."""
        start = time.perf_counter()
        prompt, multimodal_params, max_patches = request.prompt, request.multimodal_params, request.max_patches
        options = {"max_patches": max_patches} if self._encode_tiled is not None and max_patches >= 0 else {}
        items = multimodal_params.get("images") or []
        self._check_image_count(len(items) if isinstance(items, list) else 0)
        if self._images_in_prompt:  # Qwen-VL: images named inside <img>...</img>
            self._check_image_count(self.prompt_processor.count_images(prompt))  # before reading any of them
            items = await self._prompt_image_items(prompt, items, run_sync)
        expected = self.prompt_processor.count_images(prompt)
        if expected != len(items):
            raise BadRequest(FIELD, str(PromptImageMismatch(
                f"the prompt has {expected} image placeholder(s) but {len(items)} image(s) were sent; "
                "each placeholder stands for one image, in order")))  # fmt: skip
        video_items = self._video_items(prompt, multimodal_params)
        loaded, videos = await asyncio.gather(
            self._load(items, options), self._load_videos(video_items, multimodal_params.get("mm_processor_kwargs"))
        )
        images, keys = [im for im, _ in loaded], [key for _, key in loaded]
        t_load = time.perf_counter()
        # Send the new images to the visual process first, then tokenize while they encode.
        all_keys, blobs = keys + [v.key for v in videos], [im.data for im in images] + [v.data for v in videos]
        params = JobParams({v.key: v.sampling for v in videos}, options)
        acquire = asyncio.ensure_future(self._acquire(rid, items + video_items, all_keys, blobs, request.defer, params))
        sizes = [(im.width, im.height) for im in images]
        try:
            if videos:
                mm_prompt: MultimodalPrompt = await run_sync(
                    self.prompt_processor.encode, prompt, sizes, [v.plan for v in videos]
                )
            elif self._encode_tiled is not None:
                mm_prompt = await run_sync(self._encode_tiled, prompt, sizes, options.get("max_patches"))
            else:
                mm_prompt = await run_sync(self.prompt_processor.encode, prompt, sizes)
            t_prompt = time.perf_counter()
            await acquire
        except PromptImageMismatch as e:
            await self._cancel(rid, acquire)
            raise BadRequest(VIDEO_FIELD if "video" in str(e) else FIELD, str(e)) from None
        except BaseException:
            await self._cancel(rid, acquire)
            raise
        if logger.isEnabledFor(logging.DEBUG):
            now = time.perf_counter()
            logger.debug("image request timing: rid=%s images=%d load_hash_ms=%.1f prompt_ms=%.1f encode_wait_ms=%.1f "
                         "total_ms=%.1f", rid, len(images), (t_load - start) * 1e3, (t_prompt - t_load) * 1e3,
                         (now - t_prompt) * 1e3, (now - start) * 1e3)  # fmt: skip
        deferred = self._deferred[rid][3] if rid in self._deferred else set()
        refs = self._refs(mm_prompt, all_keys, deferred)
        return PreparedPrompt(mm_prompt.token_ids, refs, False)  # images are ready (or deferred): no wait

    @staticmethod
    def _refs(mm_prompt: MultimodalPrompt, keys: list[str], deferred: set[str]) -> tuple[ImageRef, ...]:
        """The references in prompt order (images and videos interleaved where the prompt says so)."""
        n = len(mm_prompt.offsets)
        sources = mm_prompt.sources or list(range(n))
        seconds = mm_prompt.second_per_grid_t or [None] * n
        grids = mm_prompt.grid_thw or [None] * n
        row_starts = mm_prompt.row_starts or [0] * n
        return tuple(
            ImageRef(keys[src], offset, count, grid, keys[src] not in deferred, second_per_grid_t=sec, row_start=row)
            for src, offset, count, grid, sec, row in zip(sources, mm_prompt.offsets, mm_prompt.num_tokens, grids,
                                                          seconds, row_starts, strict=True)
        )  # fmt: skip

    def _video_items(self, prompt: str, multimodal_params: dict) -> list:
        """The request's video entries, checked against the prompt's video placeholders and the count limit."""
        items = multimodal_params.get("videos") or []
        if not isinstance(items, list):
            raise BadRequest(VIDEO_FIELD, "must be a list")
        if not self._videos:
            if items:
                raise BadRequest(VIDEO_FIELD, "video input is not supported by this model family (images only)")
            return []
        if len(items) > self.video_policy.max_videos:
            raise BadRequest(VIDEO_FIELD, f"{len(items)} videos in one request, more than the limit of "
                                          f"{self.video_policy.max_videos} (--max_videos_per_request)")  # fmt: skip
        expected = self.prompt_processor.count_videos(prompt)
        if expected != len(items):
            raise BadRequest(VIDEO_FIELD, f"the prompt has {expected} video placeholder(s) but {len(items)} video(s) "
                                          "were sent; each placeholder stands for one video, in order")  # fmt: skip
        return items

    async def _load_videos(self, items: list, kwargs: object) -> list[LoadedVideo]:
        """Each video fetched (URLs on the loop), then its header read, sampling planned and key made in the image
        threads; then the request's totals checked."""
        if not items:
            return []
        sampling = request_sampling(kwargs, self.prompt_processor.default_video_sampling(), self.video_policy)
        loop = asyncio.get_running_loop()

        async def one(item: object) -> LoadedVideo:
            item = await fetch_item(item, self.fetcher, self.video_policy.max_bytes, "video")
            return await loop.run_in_executor(self.image_executor, load_video, item, self.video_policy,
                                              self.cache_salt, sampling, self.prompt_processor.plan_video)  # fmt: skip

        results = await asyncio.gather(*(one(item) for item in items), return_exceptions=True)
        for index, result in enumerate(results):
            if isinstance(result, BadImage):
                raise BadRequest(f"{VIDEO_FIELD}[{index}]", str(result))
            if isinstance(result, BaseException):
                raise result
        check_request_totals(results, self.video_policy)
        return results

    async def encode_deferred(self, rid: str) -> None:
        """The router found that the prefix cache does not cover `rid`'s deferred images: encode them now (held
        like the others until release). Raises as prepare would (BadRequest, ServerFailure)."""
        deferred = self._deferred.pop(rid, None)
        if deferred is None:
            return
        items, keys, data, missing, params = deferred
        self._encoding.add(rid)
        try:
            data = await self._fill_bytes(items, keys, data, missing)
            wanted = [(key, blob) for key, blob in zip(keys, data, strict=True) if key in missing]
            entries = await self._guarded_acquire(wanted, params)
        except BaseException:
            self._encoding.discard(rid)
            raise
        if rid not in self._encoding:  # the request ended meanwhile (its client went away)
            self.coordinator.release(entries)
            return
        self._encoding.discard(rid)
        self._held[rid] = self._held.get(rid, []) + entries

    def _check_image_count(self, count: int) -> None:
        if count > self.policy.max_images:
            raise BadRequest(FIELD, f"{count} images in one request, more than the limit of "
                                    f"{self.policy.max_images} (--max_images_per_request)")  # fmt: skip

    def release(self, rid: str) -> None:
        self._encoding.discard(rid)
        deferred = self._deferred.pop(rid, None)
        if deferred is not None:  # never asked for: the prefix cache held them (or the request ended before)
            self.encodes_skipped += len(deferred[3])
        entries = self._held.pop(rid, None)
        if entries:
            self.coordinator.release(entries)

    async def _prompt_image_items(self, prompt: str, sent: list, run_sync: RunSync) -> list:
        try:
            return await run_sync(self.prompt_processor.image_items, prompt, sent)
        except (BadImage, PromptImageMismatch) as e:
            raise BadRequest(FIELD, str(e)) from None

    async def aclose(self) -> None:
        await self.fetcher.aclose()

    async def _load_one(
        self, item: object, seen: SeenImages | None, options: dict | None = None
    ) -> tuple[LoadedImage, str]:
        """A URL is downloaded on the event loop (waiting on a host holds no thread), then the bytes are decoded,
        checked and hashed on image_executor. The request's preprocessing `options` are part of the key."""
        item = await fetch_item(item, self.fetcher, self.policy.max_bytes)
        variant = json.dumps(options, sort_keys=True) if options else ""
        return await asyncio.get_running_loop().run_in_executor(
            self.image_executor, load_and_key, item, self.policy, self.cache_salt + variant, seen, self._check_size,
            variant,
        )  # fmt: skip

    async def _load(self, items: list, options: dict) -> list[tuple[LoadedImage, str]]:
        loads = (self._load_one(item, self._seen, options) for item in items)
        results = await asyncio.gather(*loads, return_exceptions=True)
        for index, result in enumerate(results):
            if isinstance(result, BadImage):
                raise BadRequest(f"{FIELD}[{index}]", str(result))
            if isinstance(result, BaseException):
                raise result
        return results

    async def _fill_bytes(self, items: list, keys: list[str], data: list, wanted: set[str]) -> list[bytes | None]:
        data = list(data)
        for i, key in enumerate(keys):
            if data[i] is None and key in wanted:
                loaded, _ = await self._load_one(items[i], None)
                data[i] = loaded.data
        return data

    async def _cancel(self, rid: str, acquire: asyncio.Future) -> None:
        """Undo an acquire that is no longer wanted: nothing stays held (cancelling it releases its entries)."""
        acquire.cancel()
        await asyncio.gather(acquire, return_exceptions=True)
        self._deferred.pop(rid, None)
        self.release(rid)

    async def _acquire(
        self, rid: str, items: list, keys: list[str], data: list[bytes | None], defer: bool = False,
        params: JobParams | None = None,
    ) -> None:  # fmt: skip
        """params: what the encode jobs carry beside the bytes (the videos' sampling, the images' options)."""
        if not keys:
            return
        pairs = list(zip(keys, data, strict=True))
        missing: set[str] = set()
        while True:
            try:
                entries = await self._guarded_acquire([(k, d) for k, d in pairs if k not in missing], params)
                break
            except MissingImageData as e:  # seen before, but evicted since
                if not defer:  # decode them after all
                    data = await self._fill_bytes(items, keys, data, set(e.keys))
                    pairs = list(zip(keys, data, strict=True))
                    continue
                missing |= set(e.keys)  # left to the router (see the module's docstring); the rest is held
        if missing:
            self._deferred[rid] = (items, keys, data, missing, params or JobParams())
        self._held[rid] = entries

    async def _guarded_acquire(
        self, images: list[tuple[str, bytes | None]], params: JobParams | None = None
    ) -> list[CacheEntry]:
        """coordinator.acquire, its errors as the client should see them (MissingImageData passes through)."""
        params = params or JobParams()
        try:
            return await self.coordinator.acquire(images, params.videos, params.options)
        except CacheCapacityError as e:
            raise BadRequest(FIELD, str(e)) from None
        except EncoderUnavailable as e:
            raise ServerFailure(
                f"images cannot be encoded now ({e}); the server is restarting its visual process: "
                "retry shortly (text requests and cached images are still served)"
            ) from None
        except ImageEncodeError as e:
            if e.bad_image:
                raise BadRequest(VIDEO_FIELD if e.key in params.videos else FIELD, str(e)) from None
            # Not the image's fault (a preprocessing worker killed, shared memory full, ...): a 503, to retry.
            raise ServerFailure(f"the visual process failed to encode an image ({e.error}); retry shortly") from None
