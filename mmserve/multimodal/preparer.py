"""The HTTP process's image support, as one object the request preparer calls (`mmserve.tokenization.ImagePreparer`):
load and check the request's images, expand the prompt, hold the images' cache entries until they are encoded, and
release them when the request ends.

    preparer = MultimodalPreparer(tokenizer, prompt_processor, coordinator, cache_salt, ImagePolicy(...))
    prepared = await preparer.prepare(rid, prompt, multimodal_params, run_sync)   # BadRequest on any client error
    preparer.release(rid)                                                         # finished / aborted / failed

The request reaches the router only after its images are in the cache, so `wait_for_images` is always False.
"""

from __future__ import annotations

import asyncio

from cache.coordinator import CacheCoordinator, ImageEncodeError
from cache.index import CacheCapacityError, CacheEntry
from cache.key import cache_key
from mmserve.messages import ImageRef
from mmserve.multimodal.image_io import BadImage, ImagePolicy, LoadedImage, load_image
from mmserve.multimodal.prompt import MultimodalPrompt, PromptImageMismatch, PromptProcessor
from mmserve.protocol import BadRequest
from mmserve.tokenization import PreparedPrompt, RunSync

FIELD = "multimodal_params.images"


class MultimodalPreparer:
    def __init__(self, prompt_processor: PromptProcessor, coordinator: CacheCoordinator, cache_salt: str,
                 policy: ImagePolicy | None = None):  # fmt: skip
        self.prompt_processor = prompt_processor
        self.coordinator = coordinator
        self.cache_salt = cache_salt
        self.policy = policy or ImagePolicy()
        if hasattr(prompt_processor, "max_image_bytes"):  # Qwen-VL reads allowed paths itself: same size limit
            prompt_processor.max_image_bytes = self.policy.max_bytes
        self._held: dict[str, list[CacheEntry]] = {}  # rid -> its cache entries

    async def prepare(self, rid: str, prompt: str, multimodal_params: dict, run_sync: RunSync) -> PreparedPrompt:
        items = multimodal_params.get("images") or []
        if hasattr(self.prompt_processor, "image_items"):  # Qwen-VL: images named inside <img>...</img>
            items = await self._prompt_image_items(prompt, items, run_sync)
        expected = self.prompt_processor.count_images(prompt)
        if expected != len(items):
            raise BadRequest(FIELD, str(PromptImageMismatch(
                f"the prompt has {expected} image placeholder(s) but {len(items)} image(s) were sent; "
                "each placeholder stands for one image, in order")))  # fmt: skip
        images = await self._load(items, run_sync)
        try:
            mm_prompt: MultimodalPrompt = await run_sync(
                self.prompt_processor.encode, prompt, [(im.width, im.height) for im in images]
            )
        except PromptImageMismatch as e:
            raise BadRequest(FIELD, str(e)) from None
        if images:
            keys = await run_sync(lambda: [cache_key(im.data, self.cache_salt) for im in images])
            await self._acquire(rid, list(zip(keys, [im.data for im in images], strict=True)))
        else:
            keys = []
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

    async def _load(self, items: list, run_sync: RunSync) -> list[LoadedImage]:
        results = await asyncio.gather(*(run_sync(load_image, item, self.policy) for item in items),
                                       return_exceptions=True)  # fmt: skip
        for index, result in enumerate(results):
            if isinstance(result, BadImage):
                raise BadRequest(f"{FIELD}[{index}]", str(result))
            if isinstance(result, BaseException):
                raise result
        return results

    async def _acquire(self, rid: str, images: list[tuple[str, bytes]]) -> None:
        try:
            entries = await self.coordinator.acquire(images)
        except CacheCapacityError as e:
            raise BadRequest(FIELD, str(e)) from None
        except ImageEncodeError as e:
            if e.bad_image:
                raise BadRequest(FIELD, str(e)) from None
            raise
        self._held[rid] = entries
