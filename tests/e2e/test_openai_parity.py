"""OpenAI parity with vLLM (issue 28) through the real `openai` client against the real server (tiny random Llama,
byte-level BPE with <s>=1, </s>=2): /v1/completions' list and token-id prompts, vLLM's extra sampling fields (each
shown by its effect), continuous usage in streams, logprobs 0, the chat stream's empty deltas, refusals of what
vLLM refuses, and the /tokenize, /detokenize and /v1/models/{model} endpoints. Written from reading vLLM's
tests/entrypoints/openai (test_completion, test_chat, test_tokenization) and SGLang's test_openai_server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from mmserve.testing.server_proc import ServerProcess, serving

BOS, EOS = 1, 2
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def server(e2e_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("parity")
    (folder / "template.jinja").write_text(TEMPLATE)
    args = ("--max_total_token_num", "2048", "--chat_template", str(folder / "template.jinja"))
    with serving(ServerProcess(e2e_model_dir, str(folder / "server.log"), *args)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(e2e_model_dir):
    return AutoTokenizer.from_pretrained(e2e_model_dir)


def complete(client, model, prompt, **kwargs):
    extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
    return client.completions.create(model=model, prompt=prompt, extra_body=extra, **{**GREEDY, **kwargs})


def settled(server) -> None:
    server.wait_metric("mmserve_requests_running", lambda v: v == 0)
    server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)


# ------------------------------------------------------------------------------------------------- prompts


def test_list_and_token_id_prompts_answer_in_order(client, model, tokenizer):
    ids = tokenizer.encode("The city at night")  # with <s>, as a string prompt is tokenized
    prompts = ["Hello there", "Describe Beijing.", ids]
    alone = [complete(client, model, p) for p in prompts]
    assert alone[2].choices[0].text == complete(client, model, "The city at night").choices[0].text
    batch = complete(client, model, prompts, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone) == 36
    nested = complete(client, model, [ids, tokenizer.encode("Hello there")])
    assert [c.text for c in nested.choices] == [alone[2].choices[0].text, alone[0].choices[0].text]
    echoed = complete(client, model, [ids], echo=True, max_tokens=2)
    assert echoed.choices[0].text.startswith(tokenizer.decode(ids))


def test_list_prompts_stream_with_continuous_usage(client, model):
    prompts = ["Hello there", "Describe Beijing."]
    whole = complete(client, model, prompts)
    options = {"include_usage": True, "continuous_usage_stats": True}
    texts, seen = ["", ""], [[], []]
    usage = None
    for chunk in complete(client, model, prompts, stream=True, stream_options=options):
        if not chunk.choices:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        assert chunk.usage is not None, chunk  # on every chunk, as vLLM's continuous_usage_stats
        seen[choice.index].append(chunk.usage.completion_tokens)
    assert texts == [c.text for c in whole.choices]
    assert all(s == sorted(s) and s[-1] == 6 for s in seen)
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == 12


@pytest.mark.parametrize(
    "prompt, words",
    [([], "must be"), ([[]], "must be"), (["Hi", ""], "prompt 1"), ([[1, 5, 99999]], "[99999] are out of the voc")],
)  # fmt: skip
def test_bad_prompts_are_refused_by_name(client, model, server, prompt, words):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, model, prompt)
    error = info.value.body
    assert error["param"] == "prompt" and words in error["message"], error


def test_a_refused_prompt_of_a_list_leaves_nothing_running(client, model, server):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, model, ["Hello", "word " * 3000], max_tokens=400)
    assert info.value.body["param"] == "prompt"
    settled(server)


# ------------------------------------------------------------------------------------------------- parameters


def test_logit_bias_forces_a_token_and_names_an_unknown_id(client, model, tokenizer):
    forced = complete(client, model, "Hello", logit_bias={"300": 100})
    assert forced.choices[0].text == tokenizer.decode([300] * 6)
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, model, "Hello", logit_bias={"99999": 5})
    assert info.value.body["param"] == "logit_bias" and "99999" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, model, "Hello", logit_bias={"300": 101})
    assert info.value.body["param"] == "logit_bias"


def test_allowed_token_ids_restrict_sampling(client, model, tokenizer):
    allowed = [t for t in range(300, 340) if "\ufffd" not in tokenizer.decode([t])][:3]  # whole characters each
    out = complete(client, model, "Hello", temperature=1.5, seed=3, max_tokens=12, logprobs=0,
                   extra_body={"allowed_token_ids": allowed})  # fmt: skip
    assert set(out.choices[0].logprobs.tokens) <= {tokenizer.decode([t]) for t in allowed}


def test_min_tokens_holds_eos_back_and_stop_token_ids_stop(client, model):
    eos_first = {"logit_bias": {str(EOS): 100}, "max_tokens": 20, "extra_body": {"ignore_eos": False}}
    assert complete(client, model, "Hello", **eos_first).usage.completion_tokens == 1
    held = complete(client, model, "Hello", **{**eos_first, "extra_body": {"ignore_eos": False, "min_tokens": 5}})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    stopped = complete(client, model, "Hello", logit_bias={"300": 100}, extra_body={"stop_token_ids": [300]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, model, "Hello", max_tokens=3, extra_body={"min_tokens": 4})
    assert info.value.body["message"] == "min_tokens: must not exceed max_tokens"


def test_best_of_returns_the_n_most_likely(client, model):
    sampled = {"temperature": 1.5, "seed": 11, "max_tokens": 8, "logprobs": 0}
    three = complete(client, model, "Hello", n=3, **sampled)
    scores = [sum(c.logprobs.token_logprobs) for c in three.choices]
    best = complete(client, model, "Hello", best_of=3, **sampled)
    assert [c.text for c in best.choices] == [three.choices[scores.index(max(scores))].text]
    two = complete(client, model, "Hello", n=2, best_of=3, **sampled)
    assert len(two.choices) == 2 and [c.index for c in two.choices] == [0, 1]


def test_prompt_logprobs_score_each_prompt_token(client, model, tokenizer):
    ids = tokenizer.encode("Describe Beijing.")
    out = complete(client, model, "Describe Beijing.", max_tokens=1, extra_body={"prompt_logprobs": 2})
    scored = out.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for token, position in zip(ids[1:], scored[1:], strict=True):
        assert str(token) in position and 2 <= len(position) <= 3
        assert position[str(token)]["decoded_token"] == tokenizer.decode([token])
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})  # fmt: skip
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3


def test_do_sample_false_is_greedy(client, model):
    greedy = complete(client, model, "Hello", max_tokens=12).choices[0].text
    hot = {"temperature": 1.5, "seed": 5, "max_tokens": 12}
    assert complete(client, model, "Hello", **hot).choices[0].text != greedy
    assert complete(client, model, "Hello", **hot, extra_body={"do_sample": False}).choices[0].text == greedy


def test_skip_special_tokens_false_shows_them(client, model):
    bos = {"logit_bias": {str(BOS): 100}, "max_tokens": 3}
    assert complete(client, model, "Hello", **bos).choices[0].text == ""
    shown = complete(client, model, "Hello", **bos, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].text.replace(" ", "") == "<s><s><s>"


def test_logprobs_zero_gives_the_chosen_token(client, model):
    out = complete(client, model, "Hello", logprobs=0).choices[0].logprobs
    assert len(out.top_logprobs) == 6
    for token, lp, top in zip(out.tokens, out.token_logprobs, out.top_logprobs, strict=True):
        assert top == {token: lp}


# ------------------------------------------------------------------------------------------------- chat, refusals


def test_a_chat_token_that_completes_no_character_streams_empty_content(client, model, tokenizer):
    lead_byte = tokenizer.convert_tokens_to_ids("ä")  # byte-level BPE: the byte 0xE4, the start of a 3-byte character
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True, logprobs=True,
        logit_bias={str(lead_byte): 100}))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant"
    assert deltas[1].content == "" and all(isinstance(d.content, str) for d in deltas), deltas


def test_image_url_as_a_bare_string_is_refused(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        part = {"type": "image_url", "image_url": "data:image/png;base64,AAAA"}
        client.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [part]}])
    assert info.value.body["param"] == "messages[0].content[0].image_url"
    assert "object" in info.value.body["message"]


def test_a_json_body_sent_as_a_form_is_refused(server, model):
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2})
    form = httpx.post(server.url + "/v1/completions", content=body, timeout=60,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})  # fmt: skip
    assert form.status_code == 400 and form.json()["error"]["param"] == "body", form.text
    ok = httpx.post(server.url + "/v1/completions", content=body, timeout=60,
                    headers={"Content-Type": "application/json; charset=utf-8"})  # fmt: skip
    assert ok.status_code == 200, ok.text


# ------------------------------------------------------------------------------------------------- endpoints


def test_tokenize_and_detokenize(server, model, tokenizer):
    prompt = "Describe Beijing. <s>"
    for add_special in (False, True):
        r = httpx.post(server.url + "/tokenize", json={"model": model, "prompt": prompt,
                                                      "add_special_tokens": add_special})  # fmt: skip
        tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
        assert r.json() == {"count": len(tokens), "max_model_len": 2048, "tokens": tokens, "token_strs": None}
    strs = httpx.post(server.url + "/tokenize", json={"prompt": prompt, "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(tokenizer.encode(prompt))
    messages = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello."}]
    for add_generation in (False, True):
        text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                             add_generation_prompt=add_generation)  # fmt: skip
        r = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": add_generation})
        assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    ids = tokenizer.encode("Describe Beijing.", add_special_tokens=False)
    assert httpx.post(server.url + "/detokenize", json={"model": model, "tokens": ids}).json() == {
        "prompt": "Describe Beijing."
    }
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [5, 99999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens" and "99999" in bad.text
    other = httpx.post(server.url + "/tokenize", json={"model": "other", "prompt": "x"})
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"


def test_model_by_id(client, model):
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_openapi_documents_the_new_fields_and_routes(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {"/tokenize", "/detokenize", "/v1/models/{model}"} <= set(spec["paths"])
    fields = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"logit_bias", "best_of", "min_tokens", "allowed_token_ids", "prompt_logprobs"} <= set(fields["properties"])
