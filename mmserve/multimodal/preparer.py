"""The HTTP process's image support, as one object the request preparer calls (`mmserve.tokenization.ImagePreparer`):
load and check the request's images, expand the prompt, hold the images' cache entries until they are encoded, and
release them when the request ends.

    preparer = MultimodalPreparer(prompt_processor, coordinator, cache_salt, ImagePolicy(...), image_executor)
    prepared = await preparer.prepare(rid, prompt, multimodal_params, run_sync)   # BadRequest on any client error
    preparer.release(rid)                                                         # finished / aborted / failed

The request reaches the router only after its images are in the cache, so `wait_for_images` is always False.

Latency: each image is decoded, checked and hashed in one call on `image_executor` (threads: PNG/JPEG decoding and
xxhash release the GIL, so they scale with cores; the tokenizer pool stays free for prompts), and each new image's
EncodeJob leaves before the prompt is tokenized, so tokenizing overlaps the encoding. With DEBUG logging on, one
`image request timing:` line per request gives the stages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor

from cache.coordinator import CacheCoordinator, ImageEncodeError
from cache.index import CacheCapacityError, CacheEntry
from cache.key import cache_key
from mmserve.messages import ImageRef
from mmserve.multimodal.image_io import BadImage, ImagePolicy, LoadedImage, load_image_bytes, open_image
from mmserve.multimodal.prompt import MultimodalPrompt, PromptImageMismatch, PromptProcessor
from mmserve.protocol import BadRequest
from mmserve.tokenization import PreparedPrompt, RunSync

FIELD = "multimodal_params.images"
logger = logging.getLogger(__name__)


class SeenImages:
    """Sizes of images already decoded and checked, by cache key: the same bytes again (a follow-up turn, another
    question about one picture) skip decoding, which is most of an image's cost on the HTTP side. Bounded: it
    forgets everything when full. Read and written from the image threads (dict operations are atomic)."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._sizes: dict[str, tuple[int, int]] = {}

    def get(self, key: str) -> tuple[int, int] | None:
        return self._sizes.get(key)

    def add(self, key: str, size: tuple[int, int]) -> None:
        if len(self._sizes) >= self.capacity:
            self._sizes = {}
        self._sizes[key] = size


def load_and_key(item: object, policy: ImagePolicy, salt: str, seen: SeenImages) -> tuple[LoadedImage, str]:
    """One image entry -> the checked image and its cache key (one thread-pool hop for both)."""
    data = load_image_bytes(item, policy)
    key = cache_key(data, salt)
    size = seen.get(key)
    if size is not None:
        return LoadedImage(data, None, *size), key
    image = open_image(data, policy.max_pixels)
    seen.add(key, image.size)
    return LoadedImage(data, image, image.width, image.height), key


class MultimodalPreparer:
    def __init__(self, prompt_processor: PromptProcessor, coordinator: CacheCoordinator, cache_salt: str,
                 policy: ImagePolicy | None = None, image_executor: Executor | None = None):  # fmt: skip
        self.prompt_processor = prompt_processor
        self.image_executor = image_executor  # None: the event loop's default executor
        self.coordinator = coordinator
        self.cache_salt = cache_salt
        self.policy = policy or ImagePolicy()
        if hasattr(prompt_processor, "max_image_bytes"):  # Qwen-VL reads allowed paths itself: same size limit
            prompt_processor.max_image_bytes = self.policy.max_bytes
        self._held: dict[str, list[CacheEntry]] = {}  # rid -> its cache entries
        self._seen = SeenImages()

    async def prepare(self, rid: str, prompt: str, multimodal_params: dict, run_sync: RunSync) -> PreparedPrompt:
        start = time.perf_counter()
        items = multimodal_params.get("images") or []
        if hasattr(self.prompt_processor, "image_items"):  # Qwen-VL: images named inside <img>...</img>
            items = await self._prompt_image_items(prompt, items, run_sync)
        expected = self.prompt_processor.count_images(prompt)
        if expected != len(items):
            raise BadRequest(FIELD, str(PromptImageMismatch(
                f"the prompt has {expected} image placeholder(s) but {len(items)} image(s) were sent; "
                "each placeholder stands for one image, in order")))  # fmt: skip
        loaded = await self._load(items)
        images, keys = [im for im, _ in loaded], [key for _, key in loaded]
        t_load = time.perf_counter()
        # Send the new images to the visual process first, then tokenize while they encode.
        acquire = asyncio.ensure_future(self._acquire(rid, list(zip(keys, [im.data for im in images], strict=True))))
        try:
            mm_prompt: MultimodalPrompt = await run_sync(
                self.prompt_processor.encode, prompt, [(im.width, im.height) for im in images]
            )
            t_prompt = time.perf_counter()
            await acquire
        except PromptImageMismatch as e:
            await self._cancel(rid, acquire)
            raise BadRequest(FIELD, str(e)) from None
        except BaseException:
            await self._cancel(rid, acquire)
            raise
        if logger.isEnabledFor(logging.DEBUG):
            now = time.perf_counter()
            logger.debug("image request timing: rid=%s images=%d load_hash_ms=%.1f prompt_ms=%.1f encode_wait_ms=%.1f "
                         "total_ms=%.1f", rid, len(images), (t_load - start) * 1e3, (t_prompt - t_load) * 1e3,
                         (now - t_prompt) * 1e3, (now - start) * 1e3)  # fmt: skip
        refs = tuple(
            ImageRef(key, offset, n, mm_prompt.grid_thw[i] if mm_prompt.grid_thw else None)
            for i, (key, offset, n) in enumerate(zip(keys, mm_prompt.offsets, mm_prompt.num_tokens, strict=True))
        )
        return PreparedPrompt(mm_prompt.token_ids, refs, False)  # images are ready: no wait

    def release(self, rid: str) -> None:
        entries = self._held.pop(rid, None)
        if entries:
            self.coordinator.release(entries)

    async def _prompt_image_items(self, prompt: str, sent: list, run_sync: RunSync) -> list:
        try:
            return await run_sync(self.prompt_processor.image_items, prompt, sent)
        except (BadImage, PromptImageMismatch) as e:
            raise BadRequest(FIELD, str(e)) from None

    async def _load(self, items: list) -> list[tuple[LoadedImage, str]]:
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(
            *(loop.run_in_executor(self.image_executor, load_and_key, item, self.policy, self.cache_salt, self._seen)
              for item in items), return_exceptions=True)  # fmt: skip
        for index, result in enumerate(results):
            if isinstance(result, BadImage):
                raise BadRequest(f"{FIELD}[{index}]", str(result))
            if isinstance(result, BaseException):
                raise result
        return results

    async def _cancel(self, rid: str, acquire: asyncio.Future) -> None:
        """Undo an acquire that is no longer wanted: nothing stays held (cancelling it releases its entries)."""
        acquire.cancel()
        await asyncio.gather(acquire, return_exceptions=True)
        self.release(rid)

    async def _acquire(self, rid: str, images: list[tuple[str, bytes]]) -> None:
        if not images:
            return
        try:
            entries = await self.coordinator.acquire(images)
        except CacheCapacityError as e:
            raise BadRequest(FIELD, str(e)) from None
        except ImageEncodeError as e:
            if e.bad_image:
                raise BadRequest(FIELD, str(e)) from None
            raise
        self._held[rid] = entries
