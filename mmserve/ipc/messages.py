"""The messages that cross process boundaries, one class per boundary and purpose.

They are small pickled dataclasses of plain Python values: no tensors ever travel over a socket (image embeddings
live in shared memory and are named by their cache key). The engine's own records (RequestOutput, with its
RequestError, and EngineStats) travel as they are, never copied into look-alikes.

    HTTP server --TokenizedRequest/AbortRequest--> router <--ImagesReady-- visual process
    router --RouterBatch--> detokenizer --AbortRequest (stop sequence hit)--> router
    detokenizer --DetokBatch--> HTTP server
"""

from __future__ import annotations

from dataclasses import dataclass, field

from language.engine_stats import EngineStats
from language.request import PromptLogprobs, RequestError, RequestOutput, request_limit
from language.sampling_params import SamplingParams

# ---------------------------------------------------------------------------------------------- into the router


@dataclass(frozen=True)
class ImageRef:
    """One image of a request: its embeddings are in the cache under `key` and replace the placeholder tokens
    prompt_ids[offset : offset + num_tokens]."""

    key: str
    offset: int
    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None  # Qwen2-VL patch grid (M-RoPE positions)
    # False: the embedding cache does not hold it (it was evicted since it was seen), and it is not encoded unless
    # the router finds that the prefix cache does not cover it (then it asks: RouterBatch.encode_needed).
    embedded: bool = True
    second_per_grid_t: float | None = None  # a video's seconds per temporal patch (M-RoPE time axis); None: an image
    # The first of the entry's rows this run takes (a video split into several runs: Qwen3-VL's timestamped patches)
    row_start: int = 0


@dataclass
class TokenizedRequest:
    """HTTP server -> router: a validated, tokenized request."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    images: tuple[ImageRef, ...] = ()
    # When True the router holds the request back (it counts as waiting) until an ImagesReady for this rid arrives,
    # because the visual process is still writing its embeddings into the cache.
    wait_for_images: bool = False


@dataclass(frozen=True)
class AbortRequest:
    """HTTP server (client went away) or detokenizer (stop sequence seen) -> router: stop and free the request."""

    rid: str


@dataclass(frozen=True)
class ImagesReady:
    """HTTP server -> router: every image of request `rid` is in the embedding cache now (or failed with `error`)."""

    rid: str
    error: str | None = None


RouterInbound = TokenizedRequest | AbortRequest | ImagesReady

# ---------------------------------------------------------------------------------------- router -> detokenizer


@dataclass(frozen=True)
class DetokSetup:
    """What the detokenizer needs to know about a request before its first tokens."""

    rid: str
    stop_sequences: tuple[str, ...]
    prompt_tokens: int
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    print_eos_token: bool = False  # the special token that ended generation (EOS, a stop id) shows in the text
    include_stop: bool = False  # the stop string that ended the text stays in it (vLLM's include_stop_str_in_output)
    stop_token_ids: tuple[int, ...] = ()  # to name the one that ended generation (TextOutput.stop_reason)

    @classmethod
    def of(cls, req: TokenizedRequest) -> DetokSetup:
        p = req.params
        return cls(
            req.rid,
            p.stop_sequences,
            len(req.prompt_ids),
            p.skip_special_tokens,
            p.add_spaces_between_special_tokens,
            p.print_eos_token,
            p.include_stop_str_in_output,
            p.stop_token_ids,
        )


@dataclass(frozen=True)
class RouterStats:
    """The engine's occupancy after a step and the requests the router holds back for their images, for /metrics."""

    engine: EngineStats
    awaiting_images: int = 0

    @property
    def waiting(self) -> int:
        return self.engine.waiting + self.awaiting_images


@dataclass
class RouterBatch:
    """Router -> detokenizer, once per step: setups come first so they precede their requests' outputs."""

    setups: list[DetokSetup] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
    stats: RouterStats | None = None
    # Requests holding images sent without embeddings (ImageRef.embedded False) whose KV the prefix cache does not
    # cover: the HTTP server encodes those images, then sends ImagesReady. Passed on by the detokenizer.
    encode_needed: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------ detokenizer -> HTTP server


@dataclass(frozen=True)
class TokenDetail:
    id: int
    text: str  # the text this token completed (may be "" for the first bytes of a multi-byte character)
    logprob: float
    # the most likely tokens at this position (top_logprobs > 0 asked): (id, the token decoded alone, logprob)
    top: tuple[tuple[int, str, float], ...] = ()
    special: bool = False  # one of the tokenizer's special tokens (EOS, <|im_end|>, ...)


@dataclass
class TextOutput:
    """A piece of text of one request: `text` is safe to show (complete characters, no partial stop string)."""

    rid: str
    text: str
    tokens: list[TokenDetail]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    error: RequestError | None = None
    cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # on the first output (prompt_logprobs asked)
    scheduled_at: float | None = None  # RequestOutput.scheduled_at: when the engine admitted the request
    # vLLM's: what ended it, on the last output: the stop string, or the stop_token_ids id; None for EOS or length
    stop_reason: str | int | None = None


@dataclass
class DetokBatch:
    outputs: list[TextOutput] = field(default_factory=list)
    stats: RouterStats | None = None
    encode_needed: list[str] = field(default_factory=list)  # RouterBatch.encode_needed


# ------------------------------------------------------------------------------ child process -> parent at start


@dataclass(frozen=True)
class ReadyInfo:
    """Sent once by a child process over its start pipe when it is ready to serve (the router: model loaded)."""

    process: str
    max_total_token_num: int = 0
    max_req_total_len: int = 0
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0
    architecture: str = ""
    dtype: str = ""
    device: str = ""

    @property
    def request_limit(self) -> int:
        return request_limit(self.max_req_total_len, self.max_total_token_num)
