"""Structured output through the engine, on a tiny random-weight Llama (CPU): whatever the random weights prefer,
the output follows the grammar (JSON schemas, regexes, choices, EBNF), greedy and sampled; requests without a
constraint in the same batch are untouched; a constraint that does not compile fails that request alone; the grammar
ending the output finishes the request; constrained steps stay overlapped."""

from __future__ import annotations

import importlib
import json
import re
import threading

import jsonschema
import pytest
import torch

from language.config import EngineConfig
from language.engine import EngineCore
from language.grammar import GrammarError, Grammars
from language.request import Request, RequestRejected
from language.sampling_params import SamplingParams, StructuredOutput
from language.structured import FILL_BUDGET_S, ROW_FLOOR_S, slowest_over_budget
from mmserve.llm import LLM
from mmserve.prep.tokenizers.grammar_vocab import grammar_vocabulary
from mmserve.testing.checkpoints.llama import build_llama

SCHEMAS = [
    {  # enum and bounded integer
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["color", "n"],
        "additionalProperties": False,
    },
    {  # short string and boolean
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    },
    {  # bounded array of bounded integers
        "type": "object",
        "properties": {
            "xs": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["xs"],
        "additionalProperties": False,
    },
    {  # nested object
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 99},
                    "y": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"type": "string", "maxLength": 4},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
    {  # anyOf
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 1000},
            {
                "type": "object",
                "properties": {"s": {"enum": ["a", "b"]}},
                "required": ["s"],
                "additionalProperties": False,
            },
        ]
    },
    {"type": "array", "items": {"enum": [1, 2, "x", None, True]}, "maxItems": 4},  # mixed enum, top-level array
]
REGEX = r"[a-z]{2,5}@[a-z]{3}\.(com|org)"
CHOICES = ["alpha", "beta gamma", "δέλτα"]
EBNF = 'root ::= "(" expr ")"\nexpr ::= num | num "+" num\nnum ::= [0-9] | [1-9] [0-9]'
EBNF_MATCH = r"\((\d|[1-9]\d)(\+(\d|[1-9]\d))?\)"
# Ambiguous: the matcher's work per token grows polynomially with the a's accepted (structured.FILL_BUDGET_S).
AMBIGUOUS = r"((a|aa|aaa)*(a|aa)*)*b"
STEADY = StructuredOutput("regex", "[xyz]{300}")  # runs beside it for as long, at microseconds a token
GREEDY = dict(max_new_tokens=120)
grammar_module = importlib.import_module("language.grammar")
SAMPLED = dict(max_new_tokens=120, do_sample=True, temperature=1.0, seed=None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_llama(str(tmp_path_factory.mktemp("structured_llama")))


@pytest.fixture(scope="module")
def llm(model_dir):
    # On a GPU host these run on CUDA: decode steps replay CUDA graphs, masks go through pinned memory.
    return LLM(model_dir, max_total_token_num=4096, device="cuda" if torch.cuda.is_available() else "cpu")


def _prompt(i: int) -> str:
    return ["Give me JSON.", "What is the answer?", "A chat between a human", "Describe the image"][i % 4]


def _json(schema: dict) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema))


@pytest.mark.parametrize("mode", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_json_schemas_validate(llm, mode):
    """All schemas in one batch (the batch bitmask fill), then one alone (the single-row fill)."""
    params = [SamplingParams(**mode, structured=_json(s)) for s in SCHEMAS]
    gens = llm.generate([_prompt(i) for i in range(len(SCHEMAS))], params)
    gens.append(llm.generate([_prompt(1)], params[3])[0])
    for gen, schema in zip(gens, SCHEMAS + [SCHEMAS[3]], strict=True):
        assert gen.finish_reason == "stop", gen.text
        jsonschema.validate(json.loads(gen.text), schema)


@pytest.mark.parametrize("mode", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_regex_choice_grammar_and_json_object(llm, mode):
    kinds = [
        StructuredOutput("regex", REGEX),
        StructuredOutput("choice", json.dumps(CHOICES)),
        StructuredOutput("grammar", EBNF),
    ]
    gens = llm.generate([_prompt(i) for i in range(3)], [SamplingParams(**mode, structured=k) for k in kinds])
    regex, choice, grammar = gens
    assert all(g.finish_reason == "stop" for g in gens), [g.text for g in gens]
    assert re.fullmatch(REGEX, regex.text)
    assert choice.text in CHOICES
    assert re.fullmatch(EBNF_MATCH, grammar.text)


def test_json_object_is_any_object_without_raw_control_characters(llm):
    """json_object: any JSON object (not another JSON value); strings, bounded ones too, hold no raw control
    characters (json.loads refuses them). (A random model's free-form object need not close within a test's
    budget, so this is checked on the grammar itself.)"""
    grammars = llm.engine.structured.grammars

    def accepts(so: StructuredOutput, text: str) -> bool:
        m = grammars.matcher(grammars.compile(so).result())
        return m.accept_string(text) and m.accept_token(llm.engine.model_info.eos_token_ids[0])

    obj = StructuredOutput("json_object")
    assert accepts(obj, '{"a": [1, {"b": null}], "c": "\\u00e9"}') and accepts(obj, "{}")
    assert not accepts(obj, "[1]") and not accepts(obj, '"x"') and not accepts(obj, '{"a": "\x0b"}')
    bounded = _json(SCHEMAS[1])
    assert accepts(bounded, '{"name": "ab", "ok": true}')
    assert not accepts(bounded, '{"name": "a\x0bb", "ok": true}')
    assert not accepts(bounded, '{"name": "abcdefg", "ok": true}')


def test_unconstrained_rows_are_untouched(llm):
    """Greedy and seeded requests beside constrained ones sample exactly what they sample alone."""
    plain = [SamplingParams(max_new_tokens=24, ignore_eos=True),
             SamplingParams(max_new_tokens=24, ignore_eos=True, do_sample=True, seed=7)]  # fmt: skip
    prompts = [_prompt(0), _prompt(2)]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, plain, strict=True)]
    constrained = [
        SamplingParams(**GREEDY, structured=_json(SCHEMAS[3])),
        SamplingParams(**SAMPLED, structured=_json(SCHEMAS[0])),
    ]
    mixed = llm.generate(
        [prompts[0], _prompt(1), prompts[1], _prompt(3)], [plain[0], constrained[0], plain[1], constrained[1]]
    )
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].text), SCHEMAS[3])


def test_grammar_end_finishes_the_request(llm):
    """With ignore_eos the EOS does not stop the request, but the grammar that accepted it has ended: "stop"."""
    eos = llm.engine.model_info.eos_token_ids
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True, structured=StructuredOutput("choice", json.dumps(CHOICES)))
    gen = llm.generate([_prompt(0)], sp)[0]
    assert gen.finish_reason == "stop" and gen.token_ids[-1] in eos and len(gen.token_ids) < 40
    assert gen.text in CHOICES


@pytest.mark.parametrize(
    "bad, message",
    [
        (StructuredOutput("json", '{"type": "foo"}'), "Unsupported type"),
        (StructuredOutput("json", "{not json"), "not a JSON schema"),
        (StructuredOutput("regex", "(a"), "parenthesis"),
        (StructuredOutput("choice", '"a"'), "non-empty list of strings"),
        (StructuredOutput("grammar", "root ::= "), "EBNF"),
    ],
)
def test_bad_constraint_fails_only_its_request(llm, bad, message):
    engine = llm.engine
    good = Request("good", llm.tokenizer(_prompt(0)).input_ids, SamplingParams(**GREEDY, structured=_json(SCHEMAS[0])))
    plain = Request("plain", llm.tokenizer(_prompt(1)).input_ids, SamplingParams(max_new_tokens=12, ignore_eos=True))
    broken = Request("broken", llm.tokenizer(_prompt(2)).input_ids, SamplingParams(structured=bad))
    for r in (good, broken, plain):
        engine.add_request(r)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (failed,) = [o for o in outputs if o.rid == "broken"]
    assert failed.finished and failed.finish_reason == "error" and not failed.new_token_ids
    assert failed.error.status == 400 and failed.error.param == "parameters.structured"
    assert message in failed.error.message
    assert good.finish_reason == "stop" and plain.finish_reason == "length" and len(plain.output_ids) == 12
    jsonschema.validate(json.loads(llm.tokenizer.decode(good.output_ids, skip_special_tokens=True)), SCHEMAS[0])
    assert engine.stats().running == 0 and engine.structured.live == 0 and not engine.structured.pending


def test_a_constraint_grown_too_slow_ends_alone(llm):
    """An ambiguous regex's matcher grows with every "a" the logit bias makes the model pick, until one token's mask
    takes longer than FILL_BUDGET_S: that request ends there with a 400 naming its constraint, long before its
    max_new_tokens; a constrained request beside it (the batch fill, then each row timed alone) and a plain one
    finish as usual."""
    engine, tok = llm.engine, llm.tokenizer
    a = tok.convert_tokens_to_ids("a")
    ambiguous = StructuredOutput("regex", AMBIGUOUS)
    biased = SamplingParams(max_new_tokens=3000, logit_bias=((a, 100.0),), structured=ambiguous)
    slow = Request("slow", tok(_prompt(0)).input_ids, biased)
    steady = Request("steady", tok(_prompt(1)).input_ids, SamplingParams(max_new_tokens=400, structured=STEADY))
    plain = Request("plain", tok(_prompt(2)).input_ids, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for r in (slow, steady, plain):
        engine.add_request(r)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (failed,) = [o for o in outputs if o.rid == "slow" and o.finished]
    assert failed.finish_reason == "error" and failed.error.status == 400
    assert failed.error.param == "parameters.structured" and "too slow" in failed.error.message
    assert 20 < len(slow.output_ids) < 3000 and set(tok.decode(slow.output_ids)) == {"a"}
    assert steady.finish_reason == "stop"
    assert re.fullmatch(STEADY.spec, tok.decode(steady.output_ids, skip_special_tokens=True))
    assert plain.finish_reason == "length" and len(plain.output_ids) == 12
    assert engine.stats().running == 0 and engine.structured.live == 0


def test_the_slowest_rows_end_until_the_rest_fit_the_budget():
    """A fill over FILL_BUDGET_S: the slowest rows end until the rest, at the batch's speed-up, would fit; rows
    faster than ROW_FLOOR_S never end."""
    budget, floor = FILL_BUDGET_S, ROW_FLOOR_S
    assert slowest_over_budget([("a", 1e-4), ("slow", 2 * budget), ("b", 1e-4)], 2 * budget) == [("slow", 2 * budget)]
    rows = [(i, 2 * floor + i * 1e-5) for i in range(64)]  # 64 rows grown slow together, filled by 8 threads
    serial = sum(t for _, t in rows)
    ended = slowest_over_budget(rows, serial / 8)
    kept = serial - sum(t for _, t in ended)
    assert [i for i, _ in ended] == list(range(63, 63 - len(ended), -1))  # slowest first
    assert kept / 8 <= budget < (kept + ended[-1][1]) / 8  # no more than needed
    assert slowest_over_budget([(i, floor) for i in range(100)], 10 * budget) == []
    assert slowest_over_budget([("paused", 2 * floor)], 2 * budget) == []  # the step's fill slow, the row alone not


def test_the_grammar_cache_is_bounded_in_bytes_and_huge_masks_are_refused(llm, model_dir, monkeypatch):
    """Compiled grammars' token masks grow with the spec: the cache drops its oldest entries past _CACHE_BYTES, and
    a constraint whose masks pass MAX_GRAMMAR_BYTES fails to compile, saying so."""
    engine = llm.engine
    grammars = Grammars(grammar_vocabulary(model_dir), engine.runner.vocab_size, engine.model_info.eos_token_ids)
    specs = [_json({"enum": [f"v{i}-{j}" for j in range(50 * (i + 1))]}) for i in range(4)]
    sizes = [grammars.compile(so).result().memory_size_bytes for so in specs]
    assert grammars.cached_bytes() == sum(sizes) and all(so in grammars for so in specs)
    monkeypatch.setattr(grammar_module, "_CACHE_BYTES", sizes[2] + sizes[3])
    newest = _json({"enum": ["w"]})
    grammars.compile(newest).result()
    assert [so in grammars for so in specs] == [False, False, True, True] and newest in grammars
    monkeypatch.setattr(grammar_module, "MAX_GRAMMAR_BYTES", sizes[0])
    with pytest.raises(GrammarError, match="MiB of token masks; this server allows 0 MiB"):
        grammars.compile(_json({"enum": [f"x-{j}" for j in range(400)]})).result()
    grammars.close()


def test_constrained_steps_overlap_and_compile_once(llm):
    """A constrained step's forward is launched before the step in flight is read back (the masks are filled
    meanwhile), and the same constraint compiles once."""
    engine, order = llm.engine, []
    forward, collect = engine.runner.forward, engine._collect

    def recording_forward(staged):
        order.append("forward")
        return forward(staged)

    def recording_collect(inflight):
        order.append("collect")
        return collect(inflight)

    so = _json(SCHEMAS[2])
    assert engine.structured.grammars.compile(so) is engine.structured.grammars.compile(so)
    while engine.has_unfinished():  # a step left in flight by an earlier test
        engine.step()
    engine.runner.forward, engine._collect = recording_forward, recording_collect
    try:
        gen = llm.generate([_prompt(0)], SamplingParams(**GREEDY, structured=so))[0]
    finally:
        del engine.runner.forward, engine._collect
    jsonschema.validate(json.loads(gen.text), SCHEMAS[2])
    steps = len(gen.token_ids)
    # Each step's forward, then the previous step's read-back. The step after the last token was launched before
    # the read-back that finished the request (its row's sample will be dropped): one forward more than tokens.
    assert order == ["forward"] + ["forward", "collect"] * steps, (steps, order)


def test_compiling_requests_wait_while_others_run(model_dir):
    """Until its grammar has compiled (here: the vocabulary is held back) a request is not scheduled, and the
    engine's other requests go on."""
    release = threading.Event()
    build = grammar_vocabulary(model_dir)

    def held_vocabulary(vocab_size, stop_ids):
        release.wait(60)
        return build(vocab_size, stop_ids)

    engine = EngineCore(EngineConfig(model_dir=model_dir, device="cpu", max_total_token_num=1024), held_vocabulary)
    waiting = Request("w", [1, 5, 9], SamplingParams(**GREEDY, structured=_json(SCHEMAS[1])))
    plain = Request("p", [1, 7, 8], SamplingParams(max_new_tokens=6, ignore_eos=True))
    engine.add_request(waiting)
    engine.add_request(plain)
    while not plain.finished:
        engine.step()
    assert waiting.status.value == "waiting" and waiting.kv_len == 0 and not waiting.output_ids
    release.set()
    while engine.has_unfinished():
        engine.step()
    assert waiting.finish_reason == "stop"
    engine.close()


def test_refused_without_xgrammar(model_dir):
    so = StructuredOutput("regex", "a+")
    for mode, vocabulary in (("none", grammar_vocabulary(model_dir)), ("xgrammar", None)):
        cfg = EngineConfig(model_dir=model_dir, device="cpu", max_total_token_num=256, output_constraint_mode=mode)
        engine = EngineCore(cfg, vocabulary)
        with pytest.raises(RequestRejected) as e:
            engine.add_request(Request("r", [1, 2], SamplingParams(structured=so)))
        assert e.value.error.status == 400 and e.value.error.param == "parameters.structured"
        assert not engine.has_unfinished()
