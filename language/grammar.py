"""Grammars for structured output: each StructuredOutput compiled by xgrammar into a CompiledGrammar, off the
engine's step in a thread pool (xgrammar releases the GIL while it compiles), and cached by (kind, spec).

The vocabulary xgrammar masks over (a TokenizerInfo: every id's bytes, the mask width, the stop ids) is built by
whoever owns a tokenizer (the router or the offline LLM hand in a `VocabularyBuilder`), lazily, on the first
structured request, in the pool too: a server that never sees one never pays for it (nor for importing xgrammar,
which brings transformers: most of a second of start-up)."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from language.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

# (vocab_size: the logits' width, stop ids: the engine's EOS ids) -> the model's tokenizer as xgrammar's TokenizerInfo
VocabularyBuilder = Callable[[int, tuple[int, ...]], "xgr.TokenizerInfo"]

_CACHE_ENTRIES = 512  # compiled grammars kept (a compiled JSON schema is typically tens of KB)
# Compiled grammars' token masks grow with the spec and the vocabulary: on a 150k vocabulary, a schema of 128 tools
# compiled to 46 MB, and 240 KB of nested anyOf to 209 MB. So the cache keeps at most _CACHE_BYTES of them, and a
# constraint whose masks would take more than MAX_GRAMMAR_BYTES is refused.
_CACHE_BYTES = 2 << 30
MAX_GRAMMAR_BYTES = 512 << 20
_COMPILE_THREADS = 2
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: .*? is false: )?")  # "[17:44:11] /x/y.cc:83: "


class GrammarError(ValueError):
    """The constraint does not compile (a bad schema, regex or grammar): the message is xgrammar's, for a 400."""


class Grammars:
    """Compiles constraints in the background and caches them. `compile` returns at once with a Future of the
    CompiledGrammar that fails with GrammarError for a bad constraint; the same (kind, spec) gets the same Future."""

    def __init__(self, vocabulary: VocabularyBuilder, vocab_size: int, stop_ids: tuple[int, ...]):
        self._vocabulary, self.vocab_size, self._stop_ids = vocabulary, vocab_size, stop_ids
        self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar")
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Future] = OrderedDict()

    def compile(self, so: StructuredOutput) -> Future:
        future = self._cache.get(so)
        if future is not None:
            self._cache.move_to_end(so)
            return future
        future = self._pool.submit(self._compile, so)
        self._cache[so] = future
        self._trim()
        return future

    def __contains__(self, so: StructuredOutput) -> bool:
        return so in self._cache

    def cached_bytes(self) -> int:
        """The token masks of the compiled grammars the cache holds."""
        return sum(_compiled_bytes(f) for f in self._cache.values())

    def _trim(self) -> None:
        """Oldest first, drop entries past _CACHE_ENTRIES or _CACHE_BYTES (requests running keep their own)."""
        total = self.cached_bytes()
        while len(self._cache) > 1 and (len(self._cache) > _CACHE_ENTRIES or total > _CACHE_BYTES):
            _, dropped = self._cache.popitem(last=False)
            total -= _compiled_bytes(dropped)

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        """A fresh matcher for one request: it ends (is_terminated) once it has accepted a stop id."""
        import xgrammar as xgr  # imported by the compile that came first

        return xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        try:
            compiled = _compile(compiler, so)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse and conversion errors
            raise GrammarError(_CPP_PREFIX.sub("", str(e)).strip()) from None
        if compiled.memory_size_bytes > MAX_GRAMMAR_BYTES:
            mib, cap = compiled.memory_size_bytes / 2**20, MAX_GRAMMAR_BYTES >> 20
            raise GrammarError(f"the constraint compiles to {mib:.0f} MiB of token masks; this server allows {cap} MiB")
        return compiled

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = self._vocabulary(self.vocab_size, self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS)
            return self._compiler


def _compiled_bytes(future: Future) -> int:
    """A cache entry's token masks: 0 while it compiles or when it failed."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return 0
    return future.result().memory_size_bytes


def _compile(compiler: xgr.GrammarCompiler, so: StructuredOutput) -> xgr.CompiledGrammar:
    if so.kind == "json":
        _parse_json(so.spec, "a JSON schema")
        return compiler.compile_grammar(json_schema_grammar(so.spec))
    if so.kind == "json_object":  # OpenAI's json_object: a JSON object, not any JSON value
        return compiler.compile_grammar(json_schema_grammar('{"type": "object"}'))
    if so.kind == "regex":
        return compiler.compile_regex(so.spec)
    if so.kind == "choice":
        return compiler.compile_grammar(choice_grammar(so.spec))
    if so.kind == "grammar":
        return compiler.compile_grammar(so.spec)
    if so.kind == "structural_tag":
        _parse_json(so.spec, "a structural tag")
        return compiler.compile_structural_tag(so.spec)
    raise GrammarError(f"unknown kind {so.kind!r}")


# xgrammar (0.2.8) writes the characters of a string with a maxLength / minLength as any but quote, backslash, CR
# and LF: raw control characters then pass, which JSON forbids (json.loads refuses them), and escapes do not. Its
# unbounded strings use the class JSON allows; bounded ones get the same (escapes stay out of them).
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


def json_schema_grammar(schema: str) -> str:
    """EBNF for a JSON schema: no free whitespace, so a model cannot pad its answer with endless blanks (xgrammar's
    default allows any), and no raw control characters inside strings."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def choice_grammar(spec: str) -> str:
    """EBNF whose only sentences are the given strings (a JSON list of strings). JSON string literals are EBNF
    string literals too (the same escapes)."""
    choices = _parse_json(spec, "a JSON list of strings")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("choice must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _parse_json(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except ValueError as e:
        raise GrammarError(f"not {what}: {e}") from None
