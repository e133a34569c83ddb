"""Request preparation in the HTTP process: prompt (and later images) -> a TokenizedRequest for the router.

Everything here may be slow (tokenizing long prompts, decoding images), so the HTTP server calls it in a thread
pool, never on the event loop. Image support plugs in through `ImagePreparer` without touching the handlers: with
one installed, every request (text-only too) goes through it.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol

from language.request import length_error
from language.sampling_params import SamplingParams
from mmserve.http.protocol import BadRequest, GenerateInput
from mmserve.ipc.messages import ImageRef, TokenizedRequest
from mmserve.launch.config import ServerConfig
from mmserve.prep import tokenizers


def load_tokenizer(config: ServerConfig):
    """AutoTokenizer, or our offline loader for Qwen-VL's tiktoken vocabulary."""
    return tokenizers.load_tokenizer(config.model_dir, trust_remote_code=config.trust_remote_code)


@dataclass(frozen=True)
class PreparedPrompt:
    prompt_ids: list[int]
    images: tuple[ImageRef, ...] = ()
    wait_for_images: bool = False


@dataclass(frozen=True)
class MultimodalInput:
    """What the image preparer reads of one request."""

    prompt: str  # with the family's image (and video) placeholders
    multimodal_params: dict  # "images", "videos", "mm_processor_kwargs" as the request sent them
    # the request may use the prefix cache, so images evicted from the embedding cache since they were seen may be
    # left unencoded (ImageRef.embedded False) for the router to decide on
    defer: bool = False
    max_patches: int = -1  # the request's tile cap for a family that tiles images (-1: the checkpoint's)


RunSync = Callable[..., Awaitable]  # run_sync(fn, *args): fn(*args) in the tokenizer thread pool


class ImagePreparer(Protocol):
    """Image support, plugged in when --enable_multimodal is on: turns a prompt with image placeholders and
    `multimodal_params` into token ids with image references (raising BadRequest for bad images), doing its slow
    parts through `run_sync` so the event loop never blocks, and holding the images' cache entries until `release`."""

    async def prepare(self, rid: str, request: MultimodalInput, run_sync: RunSync) -> PreparedPrompt: ...

    async def encode_deferred(self, rid: str) -> None:
        """The router asks for `rid`'s deferred images after all (their KV is not in the prefix cache)."""
        ...

    def release(self, rid: str) -> None:
        """The request ended (finished, aborted or failed): drop what `prepare` holds for it."""
        ...


@dataclass(frozen=True)
class Limits:
    max_req_total_len: int  # prompt + new tokens, from the loaded engine (its request_limit)


class RequestPreparer:
    def __init__(self, tokenizer, limits: Limits, images: ImagePreparer | None = None):
        self.tokenizer = tokenizer
        self.limits = limits
        self.images = images
        self._special_ids = frozenset(tokenizer.all_special_ids)
        self._added: tuple[list[int], list[int]] | None = None
        self._chars_per_token = longest_token_chars(tokenizer)

    async def prepare(self, rid: str, req: GenerateInput, run_sync: RunSync) -> TokenizedRequest:
        """Validate, tokenize (in the pool) and check limits; raises BadRequest."""
        images = self._images_of(req)
        add_special = req.params.add_special_tokens
        if req.prompt_ids is not None:
            return await self._prepare_ids(rid, req, run_sync)
        if len(req.prompt) > self._prefix_chars():  # refused on a bounded prefix, never tokenized in full
            await run_sync(self._refuse_far_too_long, req.prompt)
        # Before the prompt: a request with images would otherwise take this turn through the (shared, two-thread)
        # pool only once its images are encoded, when a whole tower batch's requests queue for it at once. Without
        # stop sequences there is nothing to look up.
        params = await run_sync(self._with_stop_token_ids, req.params) if req.params.stop_sequences else req.params
        if self.images is not None:
            p = req.params  # only a request that reuses the prefix cache, and runs once, can skip an encoding
            defer = p.num_sequences == 1 and p.prompt_logprobs is None and not p.disable_prompt_cache
            request = MultimodalInput(req.prompt, req.multimodal_params, defer, req.image_max_patch_num)
            prepared = await self.images.prepare(rid, request, run_sync)
            if add_special is False:
                prepared = self._without_special_tokens(prepared)
        elif images or req.multimodal_params.get("videos"):
            name = "images" if images else "videos"
            raise BadRequest(f"multimodal_params.{name}", "this server was started without --enable_multimodal")
        elif add_special is None:
            prepared = PreparedPrompt(await run_sync(self.tokenizer.encode, req.prompt))
        else:
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=add_special)
            prepared = PreparedPrompt(await run_sync(encode, req.prompt))
        if not prepared.prompt_ids:  # e.g. add_special_tokens false and a prompt that tokenizes to nothing
            self.release(rid)
            raise BadRequest("inputs", "tokenizes to no tokens")
        try:
            if req.fill_context:
                room = self.limits.max_req_total_len - len(prepared.prompt_ids)
                params = replace(params, max_new_tokens=max(1, room))
            self._check_length(len(prepared.prompt_ids), params.max_new_tokens)
        except BaseException:
            self.release(rid)
            raise
        return TokenizedRequest(
            rid=rid,
            prompt_ids=prepared.prompt_ids,
            params=params,
            images=prepared.images,
            wait_for_images=prepared.wait_for_images,
        )

    async def _prepare_ids(self, rid: str, req: GenerateInput, run_sync: RunSync) -> TokenizedRequest:
        """A prompt given as token ids (in the vocabulary: checked where it was parsed) runs as it is. On a server
        with images its text goes through the image preparer, which refuses image placeholders (an id prompt
        carries no images) and holds nothing for a prompt without them."""
        params = await run_sync(self._with_stop_token_ids, req.params) if req.params.stop_sequences else req.params
        if self.images is not None:
            await self.images.prepare(rid, MultimodalInput(req.prompt, {}), run_sync)
        try:
            if req.fill_context:
                params = replace(params, max_new_tokens=max(1, self.limits.max_req_total_len - len(req.prompt_ids)))
            self._check_length(len(req.prompt_ids), params.max_new_tokens)
        except BaseException:
            self.release(rid)
            raise
        return TokenizedRequest(rid=rid, prompt_ids=list(req.prompt_ids), params=params)

    async def encode_deferred(self, rid: str) -> None:
        if self.images is not None:
            await self.images.encode_deferred(rid)

    def release(self, rid: str) -> None:
        if self.images is not None:
            self.images.release(rid)

    def _without_special_tokens(self, prepared: PreparedPrompt) -> PreparedPrompt:
        """add_special_tokens false on a prompt the image preparer tokenized its own way (with the tokenizer's
        special tokens): drop the ids the tokenizer adds around any text (LLaVA's BOS), moving image offsets."""
        head, tail = self._added_ids()
        ids = prepared.prompt_ids
        if not head and not tail:
            return prepared
        if ids[: len(head)] != head or (tail and ids[-len(tail) :] != tail):
            return prepared  # the preparer did not add them for this prompt
        ids = ids[len(head) : len(ids) - len(tail)]
        images = tuple(replace(ref, offset=ref.offset - len(head)) for ref in prepared.images)
        return replace(prepared, prompt_ids=ids, images=images)

    def _added_ids(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer puts before and after a text with add_special_tokens (its default)."""
        if self._added is None:
            probe = "a b"
            plain = self.tokenizer.encode(probe, add_special_tokens=False)
            full = self.tokenizer.encode(probe)
            head, tail = [], []
            for start in range(len(full) - len(plain) + 1):
                if full[start : start + len(plain)] == plain:
                    head, tail = full[:start], full[start + len(plain) :]
                    break
            self._added = (head, tail)
        return self._added

    @staticmethod
    def _images_of(req: GenerateInput) -> list:
        for name in req.multimodal_params:
            if name not in ("images", "videos", "mm_processor_kwargs"):
                raise BadRequest(f"multimodal_params.{name}", "unknown field (expected 'images' or 'videos')")
        images = req.multimodal_params.get("images") or []
        if not isinstance(images, list):
            raise BadRequest("multimodal_params.images", "must be a list")
        return images

    def _check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        """The engine's rule, checked here where the error names the client's field, before anything is queued."""
        error = length_error(prompt_len, max_new_tokens, self.limits.max_req_total_len)
        if error is not None:
            raise BadRequest.of(error)

    def _prefix_chars(self) -> int:
        """A prompt longer than this many characters has its length checked on this prefix first."""
        return (self.limits.max_req_total_len + _CUT_SLACK) * self._chars_per_token

    def _refuse_far_too_long(self, prompt: str) -> None:
        """Tokenizing a 10 MB prompt takes seconds of the shared pool; its first (limit + slack) * (longest token's
        characters) characters make at least limit + slack tokens with any vocabulary whose tokens each cover at
        most that many characters, and tokenize in milliseconds. The slack covers the word cut at the prefix's end
        (fewer tokens whole). A prefix that makes fewer tokens (a normalizer that drops characters) decides nothing:
        the whole prompt is tokenized as usual."""
        limit = self.limits.max_req_total_len
        count = len(self.tokenizer.encode(prompt[: self._prefix_chars()], add_special_tokens=False))
        if count >= limit + _CUT_SLACK:
            raise BadRequest(
                "inputs", f"the prompt is more than {count - _CUT_SLACK} tokens; this server allows {limit - 1} at most"
            )

    def _with_stop_token_ids(self, params: SamplingParams) -> SamplingParams:
        """A stop sequence that is exactly one special token (e.g. "<|im_end|>") never shows in the decoded text
        (special tokens are skipped), so it is matched on its id by the engine instead."""
        extra = []
        for stop in params.stop_sequences:
            ids = self.tokenizer.encode(stop, add_special_tokens=False)
            if len(ids) == 1 and ids[0] in self._special_ids and ids[0] not in params.stop_token_ids:
                extra.append(ids[0])
        if not extra:
            return params
        return replace(params, stop_token_ids=params.stop_token_ids + tuple(extra))


_CUT_SLACK = 64  # tokens: more than a word cut in two can gain


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of the vocabulary stands for, bounded above by its longest entry (byte-level
    BPE entries are one character per byte; SentencePiece's byte-fallback entries, "<0xE4>", are longer than the
    byte they stand for): a bound, not an exact figure."""
    vocab = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1)
