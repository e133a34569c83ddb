"""Token ids -> text pieces, incrementally and exactly, and stop sequences on the text.

Decoding one token at a time is wrong for byte-level BPE (a character's bytes may span tokens) and for
sentencepiece (a token's leading space depends on what precedes it). So, as in vLLM and TGI, each step decodes a
small window that starts at the previous read point ("prefix") and emits only the text past the prefix, and only
once it does not end in U+FFFD (an incomplete character). Concatenating the pieces gives decode(all ids).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from language.request import RequestOutput
from mmserve.ipc.messages import AbortRequest, DetokBatch, DetokSetup, RouterBatch, TextOutput, TokenDetail

# The detokenizer decodes exactly as a client calling tokenizer.decode(ids, **DECODE_KWARGS) would.
DECODE_KWARGS = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
_INCOMPLETE = "\ufffd"
# Tokens a pending character may hold the text for. One takes at most 4 (a byte each); past this many, the bytes will
# never form one (a model made to emit them), and each push would decode an ever longer window: 8,000 such tokens
# took 1 ms a push and 4 s in all, in the one process that detokenizes every request.
_MAX_HELD = 64


class IncrementalDecoder:
    """One request's decoding state."""

    def __init__(self, tokenizer, decode_kwargs: dict | None = None):
        self._tokenizer = tokenizer
        self._kwargs = DECODE_KWARGS if decode_kwargs is None else decode_kwargs
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start: the text of ids[prefix:read] was emitted already
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._kwargs)

    def push(self, token_id: int) -> str:
        """Add a token; return the text it completes ("" while a character is still incomplete)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: whatever is still pending, incomplete characters included (as decode(all ids) shows them)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        held = new_text.endswith(_INCOMPLETE) and not final and len(self.ids) - self._read_offset < _MAX_HELD
        if len(new_text) <= len(prefix_text) or held:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return new_text[len(prefix_text) :]


class StopMatcher:
    """Finds the earliest stop sequence in the growing text and holds back any tail that could still become one,
    so that streamed text never shows part of a stop string that is cut later. include: the text is cut after the
    stop string instead of before it (nothing held back then: a tail that becomes a stop string stays)."""

    def __init__(self, stop_sequences: tuple[str, ...], include: bool = False):
        self.stops = tuple(s for s in stop_sequences if s)
        self.include = include
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # all text so far (cut at the stop once one is found)
        self.released = 0  # chars of text handed out
        self.stopped = False
        self.matched: str | None = None  # the stop string found

    def add(self, piece: str) -> str:
        """Append a piece; return the text now safe to release (cut before the stop string once found)."""
        search_from = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        hit = self._find(search_from)
        if hit is not None:
            self.matched = self.text[hit[0] : hit[1]]
            self.text = self.text[: hit[1] if self.include else hit[0]]
            self.stopped = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_tail())

    def finish(self) -> str:
        return self._release(len(self.text))

    def _find(self, start: int) -> tuple[int, int] | None:
        """(start, end) of the earliest stop string from `start` (of the longest where several start there)."""
        hits = [(i, -len(s)) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        i, minus_len = min(hits)
        return i, i - minus_len

    def _held_tail(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string (none with include)."""
        if self.include:
            return 0
        for k in range(min(self._longest - 1, len(self.text) - self.released), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        out = self.text[self.released : upto]
        self.released = upto
        return out


@dataclass
class _RequestState:
    decoder: IncrementalDecoder
    stops: StopMatcher
    prompt_tokens: int
    output_tokens: int = 0
    print_eos_token: bool = False
    stop_token_ids: frozenset[int] = frozenset()


class Detokenizer:
    """Turns router batches into text batches; tells the router to abort requests that hit a stop sequence."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._spaces_kwarg: bool | None = None  # whether decode() takes spaces_between_special_tokens (learnt once)

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def handle(self, batch: RouterBatch) -> tuple[DetokBatch, list[AbortRequest]]:
        for setup in batch.setups:
            self._setup(setup)
        outputs: list[TextOutput] = []
        aborts: list[AbortRequest] = []
        for out in batch.outputs:
            state = self._states.get(out.rid)
            if state is None:  # finished here already (stop sequence); the router's late tokens are dropped
                continue
            text_out = self._step(state, out)
            outputs.append(text_out)
            if text_out.finished:
                del self._states[out.rid]
                if not out.finished:  # we stopped it: the router still holds its KV slots
                    aborts.append(AbortRequest(out.rid))
        return DetokBatch(outputs=outputs, stats=batch.stats, encode_needed=batch.encode_needed), aborts

    def _setup(self, setup: DetokSetup) -> None:
        kwargs = DECODE_KWARGS
        if not setup.skip_special_tokens or not setup.spaces_between_special_tokens:
            kwargs = {**DECODE_KWARGS, "skip_special_tokens": setup.skip_special_tokens}
            if not setup.spaces_between_special_tokens and self._takes_spaces_kwarg():
                kwargs["spaces_between_special_tokens"] = False
        self._states[setup.rid] = _RequestState(
            IncrementalDecoder(self._tokenizer, kwargs),
            StopMatcher(setup.stop_sequences, setup.include_stop),
            setup.prompt_tokens,
            print_eos_token=setup.print_eos_token,
            stop_token_ids=frozenset(setup.stop_token_ids),
        )

    def _takes_spaces_kwarg(self) -> bool:
        """Slow HF tokenizers take spaces_between_special_tokens; others may refuse it (or ignore it, harmlessly)."""
        if self._spaces_kwarg is None:
            try:
                self._tokenizer.decode([], spaces_between_special_tokens=False)
                self._spaces_kwarg = True
            except TypeError:
                self._spaces_kwarg = False
        return self._spaces_kwarg

    def _step(self, state: _RequestState, out: RequestOutput) -> TextOutput:
        text = ""
        tokens: list[TokenDetail] = []
        # The engine stops on a token id (EOS or stop_token_ids) with finish_reason "stop": the last new token. A
        # special one shows in the text only with print_eos_token (appended after everything before it is flushed),
        # whatever skip_special_tokens says; a plain-text stop token is decoded as any other.
        stop_token = None
        if out.finished and out.finish_reason == "stop" and out.new_token_ids:
            if out.new_token_ids[-1] in self._special_ids:
                stop_token = len(out.new_token_ids) - 1
        tops = self._top_tokens(out.new_top_logprobs) if out.new_top_logprobs else [()] * len(out.new_token_ids)
        for i, (token_id, logprob) in enumerate(zip(out.new_token_ids, out.new_logprobs, strict=True)):
            if i == stop_token:
                piece = state.decoder.flush()
                if state.print_eos_token:
                    piece += self._tokenizer.decode([token_id], skip_special_tokens=False)
            else:
                piece = state.decoder.push(token_id)
            state.output_tokens += 1
            tokens.append(TokenDetail(token_id, piece, logprob, tops[i], token_id in self._special_ids))
            text += state.stops.add(piece)
            if state.stops.stopped:
                break
        stopped = state.stops.stopped
        if out.finished and not stopped:
            rest = state.decoder.flush()
            if rest and tokens:  # the last token completed it
                last = tokens[-1]
                tokens[-1] = replace(last, text=last.text + rest)
            text += state.stops.add(rest)
            stopped = state.stops.stopped
        finished = out.finished or stopped
        if finished:
            text += state.stops.finish()
        return TextOutput(
            rid=out.rid,
            text=text,
            tokens=tokens,
            finished=finished,
            finish_reason="stop" if stopped else out.finish_reason,
            prompt_tokens=state.prompt_tokens,
            output_tokens=state.output_tokens,
            error=out.error,
            cached_tokens=out.cached_tokens,
            prompt_logprobs=out.prompt_logprobs,
            scheduled_at=out.scheduled_at,
            stop_reason=_stop_reason(state, out) if finished else None,
        )

    def _top_tokens(self, tops: list[list[tuple[int, float]]]) -> list[tuple[tuple[int, str, float], ...]]:
        """Each position's alternatives with their text: every token decoded alone, special tokens shown (as vLLM
        decodes logprob tokens), all of a step's in one batch_decode call."""
        texts = iter(self._tokenizer.batch_decode([[i] for top in tops for i, _ in top], skip_special_tokens=False))
        return [tuple((i, next(texts), lp) for i, lp in top) for top in tops]


def _stop_reason(state: _RequestState, out: RequestOutput) -> str | int | None:
    """vLLM's stop_reason: the stop string the text ended at, else the stop_token_ids id the engine stopped on, else
    None (EOS, the length, an abort)."""
    if state.stops.matched is not None:
        return state.stops.matched
    last = out.new_token_ids[-1] if out.new_token_ids else None
    if out.finish_reason == "stop" and last in state.stop_token_ids:
        return last
    return None
