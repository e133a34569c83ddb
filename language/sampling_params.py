"""Per-request generation parameters, validated once at the boundary."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field


class InvalidParams(ValueError):
    """A generation parameter is out of range; `field` names it for the 400 answer."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


MAX_SEQUENCES = 16  # most sequences (n / best_of) one HTTP request may ask for
MAX_TOP_LOGPROBS = 20  # most alternatives per position (OpenAI's top_logprobs limit)
# What the engine's tensors hold: token ids and top_k fit int32 (a top_k above the vocabulary cuts nothing), and
# every factor stays a finite, non-zero float32 through the sampler's arithmetic.
MAX_TOKEN_ID = 2**31 - 1
MAX_TOP_K = 2**31 - 1
MIN_TOP_P = 1e-8  # float32 keeps it non-zero, so the most likely token always survives the cut
MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy (vLLM's epsilon): logits / 1e-40 is inf in float32
MIN_REPETITION_PENALTY = 0.01  # logit / penalty and logit * penalty stay finite (a 5e-324 penalty is 0 in float32)
MAX_REPETITION_PENALTY = 10.0
MAX_DECAY_FACTOR = 10.0  # exponential_decay_length_penalty's; the EOS boost is capped as well (LogitProcessors)
MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, regex or grammar longer than 1 MiB of text is refused before compiling
MAX_TOKEN_LIST = 1 << 20  # most ids in stop_token_ids or allowed_token_ids (a 64 MiB body holds ~20 M)
# The detokenizer, one process for every request, looks for each stop string in each new piece of text: 100,000
# strings took it 25 ms a token. These bound it to ~1 ms.
MAX_STOP_SEQUENCES = 256
MAX_STOP_CHARS = 4096


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output that xgrammar compiles into a token mask, whatever the client called it
    (OpenAI's response_format, vLLM's structured_outputs / guided_*, LightLLM's guided_json / guided_grammar).

    kind: "json" (spec: a JSON schema as text), "json_object" (any JSON object; spec ""), "regex", "choice" (spec: a
    JSON list of the allowed strings), "grammar" (EBNF/GBNF text) or "structural_tag" (xgrammar's JSON)."""

    kind: str
    spec: str = ""

    KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k cut
    min_p: float = 0.0  # vLLM's and HF's: drop ids less likely than min_p times the most likely (0: off)
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[str, ...] = ()  # matched on text by the detokenizer
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    return_details: bool = False
    disable_prompt_cache: bool = False  # neither reuse nor share this request's KV (LightLLM's name)
    # EOS (unless ignore_eos) and stop_token_ids are masked out of the logits until this many tokens are out.
    min_new_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None  # only these ids may be sampled
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), OpenAI's semantics
    # HF's (start_index, decay_factor): after start_index output tokens, the EOS logit grows by
    # |logit| * (decay_factor ** (generated - start_index) - 1).
    exponential_decay_length_penalty: tuple[int, float] | None = None
    input_penalty: bool = False  # LightLLM: frequency/presence penalties count the prompt's tokens too
    # The HTTP side fans n / best_of out into that many engine requests and keeps the n most likely (the engine
    # itself always runs one sequence per request).
    n: int = 1
    best_of: int | None = None
    # Text: how the detokenizer decodes (skip_special_tokens, add_spaces_between_special_tokens), whether the EOS /
    # stop token that ended generation shows in the text, and add_special_tokens for the prompt (None: the
    # tokenizer's default).
    skip_special_tokens: bool = True
    add_spaces_between_special_tokens: bool = True
    print_eos_token: bool = False
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the text stays in it
    add_special_tokens: bool | None = None
    # Log-probabilities: the `top_logprobs` most likely tokens of each sampled position (OpenAI's top_logprobs), and
    # for the prompt (None: off) each prompt token's own plus that many alternatives (vLLM's prompt_logprobs).
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # the output follows this grammar (a token mask at every step)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @functools.cached_property
    def stop_id_set(self) -> frozenset[int]:
        """stop_token_ids as a set: the engine looks each sampled token up in it."""
        return frozenset(self.stop_token_ids)

    def min_tokens_bans(self, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
        """The ids masked out of the logits until min_new_tokens are out: stop_token_ids, and EOS unless ignore_eos."""
        return self.stop_id_set if self.ignore_eos else self.stop_id_set | frozenset(eos_token_ids)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def has_logit_processors(self) -> bool:
        """Needs the sampler's sparse logit edits (bias, allowed ids, min-new-tokens bans, EOS boost)."""
        return (
            self.min_new_tokens > 0
            or self.allowed_token_ids is not None
            or bool(self.logit_bias)
            or self.exponential_decay_length_penalty is not None
        )

    @property
    def has_logit_masks(self) -> bool:
        """Needs logits processing (those edits, or a grammar's token mask): never takes the greedy argmax fast path."""
        return self.has_logit_processors or self.structured is not None

    @property
    def num_sequences(self) -> int:
        """Engine requests the HTTP side runs for this one (best_of, else n)."""
        return self.best_of if self.best_of is not None else self.n

    def validate(self) -> SamplingParams:
        if not isinstance(self.do_sample, bool):
            raise InvalidParams("do_sample", "must be a boolean")
        if not _is_number(self.temperature) or self.temperature < 0.0 or self.temperature > 100.0:
            raise InvalidParams("temperature", "must be a number in [0, 100]")
        if not _is_number(self.top_p) or not MIN_TOP_P <= self.top_p <= 1.0:
            raise InvalidParams("top_p", f"must be a number in [{MIN_TOP_P:g}, 1]")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidParams("min_p", "must be a number in [0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidParams("top_k", f"must be -1 or 0 (disabled) or an integer in [1, {MAX_TOP_K}]")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidParams("max_new_tokens", "must be an integer >= 1")
        if not _is_number(self.repetition_penalty) or not (
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise InvalidParams(
                "repetition_penalty", f"must be a number in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]"
            )
        if not _is_number(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidParams("frequency_penalty", "must be a number in [-2, 2]")
        if not _is_number(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidParams("presence_penalty", "must be a number in [-2, 2]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise InvalidParams("seed", "must be a non-negative integer below 2**63")
        if not isinstance(self.disable_prompt_cache, bool):
            raise InvalidParams("disable_prompt_cache", "must be a boolean")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParams("ignore_eos", "must be a boolean")
        for name in ("stop_token_ids", "allowed_token_ids"):  # the engine keeps a set or a tensor of each
            ids = getattr(self, name)
            if isinstance(ids, (tuple, list)) and len(ids) > MAX_TOKEN_LIST:
                raise InvalidParams(name, f"at most {MAX_TOKEN_LIST} token ids")
        if not all(_is_token_id(t) for t in self.stop_token_ids):
            raise InvalidParams("stop_token_ids", f"must be integers in [0, {MAX_TOKEN_ID}]")
        if not all(isinstance(s, str) and s for s in self.stop_sequences):
            raise InvalidParams("stop_sequences", "must be non-empty strings")
        stops = self.stop_sequences
        if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stops):
            limit = f"at most {MAX_STOP_SEQUENCES} strings of {MAX_STOP_CHARS} characters"
            raise InvalidParams("stop_sequences", limit)
        if not _is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise InvalidParams("min_new_tokens", "must be an integer >= 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidParams("min_new_tokens", "must not exceed max_new_tokens")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or not all(_is_token_id(t) for t in self.allowed_token_ids)
        ):
            raise InvalidParams("allowed_token_ids", f"must be a non-empty list of token ids in [0, {MAX_TOKEN_ID}]")
        for pair in self.logit_bias:
            if len(pair) != 2 or not _is_token_id(pair[0]):
                raise InvalidParams("logit_bias", f"keys must be token ids in [0, {MAX_TOKEN_ID}]")
            if not _is_number(pair[1]) or not -100.0 <= pair[1] <= 100.0:
                raise InvalidParams("logit_bias", "biases must be numbers in [-100, 100]")
        decay = self.exponential_decay_length_penalty
        if decay is not None and (
            len(decay) != 2
            or not (_is_int(decay[0]) and 0 <= decay[0] <= MAX_TOKEN_ID)
            or not (_is_number(decay[1]) and 1.0 <= decay[1] <= MAX_DECAY_FACTOR)
        ):
            raise InvalidParams(
                "exponential_decay_length_penalty",
                f"must be [start_index in [0, {MAX_TOKEN_ID}], decay_factor in [1, {MAX_DECAY_FACTOR:g}]]",
            )
        for name in (
            "input_penalty", "skip_special_tokens", "add_spaces_between_special_tokens", "print_eos_token",
            "include_stop_str_in_output",
        ):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise InvalidParams(name, "must be a boolean")
        if self.add_special_tokens is not None and not isinstance(self.add_special_tokens, bool):
            raise InvalidParams("add_special_tokens", "must be a boolean")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParams("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidParams("prompt_logprobs", f"must be null, true or an integer in [0, {MAX_TOP_LOGPROBS}]")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_SEQUENCES:
            raise InvalidParams("n", f"must be an integer in [1, {MAX_SEQUENCES}]")
        if self.best_of is not None:
            if not _is_int(self.best_of) or not 1 <= self.best_of <= MAX_SEQUENCES:
                raise InvalidParams("best_of", f"must be an integer in [1, {MAX_SEQUENCES}]")
            if self.best_of < self.n:
                raise InvalidParams("best_of", "must be >= n")
        so = self.structured
        if so is not None:
            if not isinstance(so, StructuredOutput) or so.kind not in StructuredOutput.KINDS:
                raise InvalidParams("structured", f"kind must be one of {', '.join(StructuredOutput.KINDS)}")
            if not isinstance(so.spec, str) or len(so.spec) > MAX_CONSTRAINT_CHARS:
                raise InvalidParams("structured", f"must be text of at most {MAX_CONSTRAINT_CHARS} characters")
        return self


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_token_id(x: object) -> bool:
    return _is_int(x) and 0 <= x <= MAX_TOKEN_ID
