"""Per-request generation parameters, validated once at the boundary."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidParams(ValueError):
    """A generation parameter is out of range; `field` names it for the 400 answer."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k cut
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
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature <= 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self) -> SamplingParams:
        if not isinstance(self.do_sample, bool):
            raise InvalidParams("do_sample", "must be a boolean")
        if not _is_number(self.temperature) or self.temperature < 0.0 or self.temperature > 100.0:
            raise InvalidParams("temperature", "must be a number in [0, 100]")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidParams("top_p", "must be a number in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            raise InvalidParams("top_k", "must be -1 (disabled) or an integer >= 0")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidParams("max_new_tokens", "must be an integer >= 1")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidParams("repetition_penalty", "must be a number in (0, 10]")
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
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidParams("stop_token_ids", "must be non-negative integers")
        if not all(isinstance(s, str) and s for s in self.stop_sequences):
            raise InvalidParams("stop_sequences", "must be non-empty strings")
        return self


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
