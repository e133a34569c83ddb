"""Log-probabilities from the engine against HF transformers on the same tiny Llama (CPU, fp32): each sampled
position's top-k alternatives equal HF's log-softmax of its scores at that step, and prompt_logprobs equal HF's
forward logits over the prompt, with the prompt split into several prefill chunks, beside requests that ask for
nothing, and with the prefix cache bypassed (a repeated prompt is scored again, not served from the cache)."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from language.request import Request, RequestOutput
from language.sampling_params import SamplingParams
from mmserve.llm import LLM

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # chunks of 16 prompt tokens per step: the 40-token prompts below take three steps each
    return LLM(tiny_llama_dir, max_total_token_num=2048, device="cpu", chunked_prefill_size=16)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]


def _hf_log_softmax(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)  # [len, vocab]


def _run(llm, reqs: list[Request]) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {r.rid: [] for r in reqs}
    for r in reqs:
        llm.engine.add_request(r)
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            outputs[out.rid].append(out)
    return outputs


def test_top_logprobs_equal_hf_log_softmax_at_each_step(llm, hf_model):
    vocab = hf_model.config.vocab_size
    asks = Request("asks", _prompt(11, 0, vocab), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                                 top_logprobs=5))  # fmt: skip
    plain = Request("plain", _prompt(7, 1, vocab), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    many = Request("many", _prompt(23, 2, vocab), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                                 top_logprobs=20))  # fmt: skip
    outputs = _run(llm, [asks, plain, many])
    assert all(o.new_top_logprobs is None for o in outputs["plain"])
    for req, k in ((asks, 5), (many, 20)):
        tops = [t for o in outputs[req.rid] for t in (o.new_top_logprobs or [])]
        assert len(tops) == NEW_TOKENS
        table = _hf_log_softmax(hf_model, req.prompt_ids + req.output_ids)[req.prompt_len - 1 : -1]  # [new, vocab]
        values, ids = table.topk(k, dim=-1)
        for step, top in enumerate(tops):
            assert [i for i, _ in top] == ids[step].tolist()
            assert [lp for _, lp in top] == pytest.approx(values[step].tolist(), abs=1e-4)
            assert top[0] == (req.output_ids[step], pytest.approx(req.output_logprobs[step], abs=1e-6))


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_hf_forward_logits_across_chunks(llm, hf_model, k):
    vocab = hf_model.config.vocab_size
    prompt = _prompt(40, 5, vocab)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, prompt_logprobs=k)
    table = _hf_log_softmax(hf_model, prompt)[:-1]  # position i scores token i + 1
    expected = table.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    for attempt in range(2):  # the second run finds the prompt in the prefix cache, yet is scored in full again
        reqs = [
            Request(f"scored-{k}-{attempt}", list(prompt), params),
            Request(f"beside-{k}-{attempt}", _prompt(30, 6, vocab), SamplingParams(max_new_tokens=3)),
        ]
        outputs = _run(llm, reqs)
        firsts = [o for o in outputs[reqs[0].rid] if o.new_token_ids]
        scores = firsts[0].prompt_logprobs
        assert all(o.prompt_logprobs is None for o in firsts[1:] + outputs[reqs[1].rid])
        assert scores.token_ids == prompt and len(scores.logprobs) == len(prompt) - 1
        assert scores.logprobs == pytest.approx(expected, abs=1e-4)
        assert firsts[0].cached_tokens == 0
        if k:
            values, ids = table.topk(k, dim=-1)
            assert [[i for i, _ in top] for top in scores.top] == ids.tolist()
            assert [lp for top in scores.top for _, lp in top] == pytest.approx(values.flatten().tolist(), abs=1e-4)
        else:
            assert scores.top is None
    assert llm.engine.stats().kv_used == 0
