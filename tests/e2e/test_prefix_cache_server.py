"""The prefix cache's acceptance over HTTP, for LLaVA-1.5 and Qwen2-VL (tiny random checkpoints, real server
processes, --enable_multimodal): greedy tokens with the cache on equal those of the same request with the cache off
(`parameters.disable_prompt_cache`, or a server started with --disable_dynamic_prompt_cache) and HF transformers'.

Each family's server is checked against a model of the radix tree kept here: every cache-on request inserts its
prompt (image placeholder runs keyed by the image) and all its answer tokens but the last, so a sequential request's
`prompt_cache_len` is exactly its longest prefix found in that model (at most prompt_len - 1), and the server's
`mmserve_prefix_cache_tokens` is exactly the model's size (no slot held twice, none lost) as long as nothing is
evicted (the KV cache is sized for that). Eviction is checked on its own small server under a random load."""

from __future__ import annotations

import hashlib
import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
import torch
from PIL import Image
from transformers import (
    AutoProcessor,
    AutoTokenizer,
    LlavaForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

from mmserve.testing.checkpoints.llava import SYSTEM_PROMPT, build_llava_hf
from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
from mmserve.testing.images import picture, png_b64
from mmserve.testing.server_proc import ServerProcess, serving
from tests.models.hf_reference import hf_greedy

NEW_TOKENS = 10
KV_SLOTS = 16384  # the per-family servers never evict: their tree is compared with the model kept here
LONG_SYSTEM = " ".join(["You are a careful assistant who looks at every picture twice before answering."] * 6)
USED, TREE, HITS = "mmserve_kv_tokens_used", "mmserve_prefix_cache_tokens", "mmserve_prefix_cache_hit_tokens_total"
LOGPROB_TOL = 1e-4  # cache on vs off: the same math, in differently shaped batches and chunks


# ------------------------------------------------------------------------------------------ the two families


class Family:
    """Prompt format, HF tokenization (placeholders expanded) and the HF reference model of one family."""

    def __init__(self, name: str, model_dir: str):
        self.name, self.model_dir = name, model_dir
        config = json.load(open(os.path.join(model_dir, "config.json")))
        if name == "llava":
            self.image_token = config["image_token_index"]
            self.processor = AutoProcessor.from_pretrained(model_dir)
        else:
            self.image_token = config["image_token_id"]
            self.processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(model_dir),
                                              tokenizer=AutoTokenizer.from_pretrained(model_dir),
                                              video_processor=Qwen2VLVideoProcessor())  # fmt: skip
        self._model = None

    def chat(self, turns: list[tuple[str, int, str | None]], system: str | None = None) -> str:
        """The prompt of a chat: each turn is (question, number of images before it, answer or None for the turn
        to be answered), in the family's published chat format."""
        if self.name == "qwen2_vl":
            out = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
            for question, n_images, answer in turns:
                vision = "<|vision_start|><|image_pad|><|vision_end|>" * n_images
                out += f"<|im_start|>user\n{vision}{question}<|im_end|>\n<|im_start|>assistant\n"
                if answer is not None:
                    out += f"{answer}<|im_end|>\n"
            return out
        out = (system or SYSTEM_PROMPT) + " "  # LLaVA-1.5's conv_vicuna_v1: sep " ", sep2 "</s>"
        for question, n_images, answer in turns:
            out += "USER: " + "<image>\n" * n_images + question + " ASSISTANT:"
            if answer is not None:
                out += f" {answer}</s>"
        return out

    def inputs(self, text: str, images: list[Image.Image]) -> dict:
        return self.processor(text=[text], images=images or None, return_tensors="pt")

    def prompt_ids(self, text: str, images: list[Image.Image]) -> list[int]:
        return self.inputs(text, images)["input_ids"][0].tolist()

    def image_runs(self, ids: list[int]) -> list[tuple[int, int]]:
        """[start, end) of each image's placeholder run, in order."""
        runs, start = [], None
        for i, t in enumerate([*ids, -1]):
            if t == self.image_token and start is None:
                start = i
            elif t != self.image_token and start is not None:
                runs.append((start, i))
                start = None
        return runs

    def cache_ids(self, ids: list[int], images: list[Image.Image]) -> list:
        """The prompt as the tree keys it: each placeholder run becomes ids naming the image (by its bytes)."""
        runs = self.image_runs(ids)
        assert len(runs) == len(images)
        out: list = list(ids)
        for (start, end), image in zip(runs, images, strict=True):
            key = hashlib.sha256(image.tobytes() + repr(image.size).encode()).hexdigest()
            out[start:end] = [(key, i) for i in range(end - start)]
        return out

    @property
    def model(self):
        if self._model is None:
            cls = LlavaForConditionalGeneration if self.name == "llava" else Qwen2VLForConditionalGeneration
            self._model = cls.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        return self._model

    def hf(self, text: str, images: list[Image.Image], max_new_tokens: int = NEW_TOKENS) -> list[int]:
        """HF's greedy tokens (generate)."""
        inputs = self.inputs(text, images)
        extra = {k: v for k, v in inputs.items() if k != "input_ids"}
        return hf_greedy(self.model, inputs["input_ids"][0].tolist(), max_new_tokens, **extra)

    def hf_argmax(self, text: str, images: list[Image.Image], answer: list[int]) -> list[int]:
        """HF's argmax after the prompt and each prefix of `answer`, from one forward over prompt + answer (teacher
        forcing): equal to `answer` exactly when `answer` is HF's greedy continuation."""
        inputs = self.inputs(text, images)
        n = inputs["input_ids"].shape[1]
        full = torch.cat([inputs["input_ids"], torch.tensor([answer[:-1]])], dim=1)
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        if "mm_token_type_ids" in inputs:  # the answer is text
            extra["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, len(answer) - 1))
        with torch.no_grad():
            logits = self.model(input_ids=full, attention_mask=torch.ones_like(full), **extra).logits
        return logits[0, n - 1 :].argmax(-1).tolist()


class TreeModel:
    """A trie of the id sequences the server's prefix cache must hold (while it evicts nothing)."""

    def __init__(self):
        self.root: dict = {}
        self.size = 0

    def insert(self, seq: list) -> None:
        node = self.root
        for t in seq:
            if t not in node:
                node[t] = {}
                self.size += 1
            node = node[t]

    def match(self, seq: list) -> int:
        node, n = self.root, 0
        for t in seq:
            if t not in node:
                break
            node, n = node[t], n + 1
        return n


def common_len(a: list, b: list) -> int:
    """Length of the common prefix of two id lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def request_body(text: str, images: list[Image.Image], params: dict) -> dict:
    return {"inputs": text, "parameters": params,
            "multimodal_params": {"images": [{"type": "base64", "data": png_b64(im)} for im in images]}}  # fmt: skip


@dataclass
class Answer:
    ids: list[int]
    logprobs: list[float]
    text: str
    prompt_tokens: int
    prompt_cache_len: int


def post(srv: ServerProcess, text: str, images: list[Image.Image], max_new_tokens: int = NEW_TOKENS,
         cache: bool = True) -> Answer:  # fmt: skip
    params = {"max_new_tokens": max_new_tokens, "ignore_eos": True, "return_details": True}
    if not cache:
        params["disable_prompt_cache"] = True
    r = httpx.post(srv.url + "/generate", json=request_body(text, images, params), timeout=300)
    assert r.status_code == 200, r.text
    j = r.json()
    return Answer([t["id"] for t in j["tokens"]], [t["logprob"] for t in j["tokens"]], j["generated_text"][0],
                  j["prompt_tokens"], j["prompt_cache_len"])  # fmt: skip


class Served:
    """One family's server with the cache on, and the tree model its cache-on requests have built."""

    def __init__(self, family: Family, srv: ServerProcess):
        self.family, self.srv, self.tree = family, srv, TreeModel()
        self.hits = 0  # the sum of the cache-on answers' prompt_cache_len

    def expected_reuse(self, text: str, images: list[Image.Image]) -> int:
        ids = self.family.cache_ids(self.family.prompt_ids(text, images), images)
        return self.tree.match(ids[:-1])

    def generate(self, text: str, images: list[Image.Image], sequential: bool = True) -> Answer:
        """A cache-on request, recorded in the tree model (its prompt, and its answer but the last token). Alone on
        the server (sequential), it must reuse exactly its longest prefix in the model."""
        expected = self.expected_reuse(text, images)
        answer = post(self.srv, text, images)
        ids = self.family.prompt_ids(text, images)
        assert answer.prompt_tokens == len(ids)
        assert 0 <= answer.prompt_cache_len < len(ids)
        if sequential:
            assert answer.prompt_cache_len == expected, "reuse differs from the longest cached prefix"
        self.tree.insert(self.family.cache_ids(ids, images) + answer.ids[:-1])
        self.hits += answer.prompt_cache_len
        return answer

    def generate_concurrently(self, jobs: list[tuple[str, list[Image.Image]]]) -> list[Answer]:
        with ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(lambda job: self.generate(*job, sequential=False), jobs))

    def check(self, text: str, images: list[Image.Image], answer: Answer, teacher_forced: bool = False) -> Answer:
        """`answer` (cache on) equals the same request with the cache off, and HF's greedy tokens (from generate, or
        teacher_forced: from one forward over prompt + answer)."""
        off = post(self.srv, text, images, len(answer.ids), cache=False)
        assert off.prompt_cache_len == 0
        assert answer.ids == off.ids, "cache on and off disagree"
        assert answer.logprobs == pytest.approx(off.logprobs, abs=LOGPROB_TOL)
        if teacher_forced:
            assert answer.ids == self.family.hf_argmax(text, images, answer.ids), "cache on and HF disagree"
        else:
            assert answer.ids == self.family.hf(text, images, len(answer.ids)), "cache on and HF disagree"
        return off

    def check_tree(self) -> None:
        """Idle: no request holds a slot, the tree holds each distinct prefix once, and the hit counter is the sum
        of the answers' prompt_cache_len."""
        assert self.srv.wait_metric(USED, lambda v: v == 0) == 0
        assert self.srv.wait_metric(TREE, lambda v: v == self.tree.size) == self.tree.size
        assert self.srv.wait_metric(HITS, lambda v: v == self.hits) == self.hits


def build(name: str, root) -> str:
    return build_llava_hf(str(root)) if name == "llava" else build_qwen2_vl(str(root))


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def served(request, tmp_path_factory):
    name = request.param
    model_dir = build(name, tmp_path_factory.mktemp(name))
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / f"{name}.log"), "--max_total_token_num",
                        str(KV_SLOTS), "--enable_multimodal")  # fmt: skip
    with serving(srv):
        yield Served(Family(name, model_dir), srv)


# ----------------------------------------------------------------------------------------------------- tests


def test_same_image_another_question_reuses_past_the_image(served):
    fam = served.family
    image = picture(120, 90, seed=101)
    first = fam.chat([("Look closely at this picture. What color is it?", 1, None)])
    second = fam.chat([("Look closely at this picture. How many objects are there?", 1, None)])

    a = served.generate(first, [image])
    served.check(first, [image], a)
    b = served.generate(second, [image])
    ids = fam.prompt_ids(second, [image])
    ((start, end),) = fam.image_runs(ids)
    common = common_len(ids, fam.prompt_ids(first, [image]))
    assert end < common  # the questions share their first words
    assert b.prompt_cache_len > end - 1  # past the image's last placeholder
    assert b.prompt_cache_len == common  # exactly the prompts' common prefix
    served.check(second, [image], b)

    # The last event of a stream carries prompt_cache_len too: the whole prompt but its last token this time.
    body = request_body(second, [image], {"max_new_tokens": 3, "ignore_eos": True})
    with httpx.stream("POST", served.srv.url + "/generate_stream", json=body, timeout=300) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1]["finished"] and events[-1]["prompt_cache_len"] == len(ids) - 1
    assert [e["token"]["id"] for e in events] == b.ids[:3]
    served.tree.insert(fam.cache_ids(ids, [image]) + b.ids[:2])
    served.hits += len(ids) - 1
    served.check_tree()


def test_another_image_of_the_same_size_reuses_nothing_from_the_image_on(served):
    fam = served.family
    question = fam.chat([("What is shown in this picture?", 1, None)])
    one, other = picture(100, 140, seed=201), picture(100, 140, seed=202)  # same size: same placeholder count

    a = served.generate(question, [one])
    served.check(question, [one], a)
    ids = fam.prompt_ids(question, [other])
    assert ids == fam.prompt_ids(question, [one])  # the same ids: only the image key tells them apart
    ((start, _),) = fam.image_runs(ids)
    b = served.generate(question, [other])
    assert b.prompt_cache_len <= start  # nothing from the image on
    assert b.prompt_cache_len == start  # and all the text before it (every earlier prompt starts with it)
    served.check(question, [other], b)
    # The test can fail: the two images lead to different answers, so KV reused across them would show.
    assert a.logprobs != pytest.approx(b.logprobs, abs=1e-3)
    # Both stay cached: the first image again reuses all its prompt but the last token.
    again = served.generate(question, [one])
    assert again.prompt_cache_len == len(ids) - 1
    assert again.ids == a.ids and again.logprobs == pytest.approx(a.logprobs, abs=LOGPROB_TOL)
    served.check_tree()


def test_prompt_ending_with_its_image_reuses_part_of_the_image(served):
    """A prompt whose last token is an image placeholder: its repeat reuses all but that token, so the one token
    prefilled is the image's last embedding row (at its M-RoPE position for Qwen2-VL), after a cached part-image.
    HF is checked by teacher forcing here: for such a prompt, transformers 5's Qwen2-VL `generate` departs from its
    own forward over the same ids after a few tokens (the server agrees with the forward)."""
    fam = served.family
    image = picture(140, 84, seed=251)
    text = fam.chat([("", 1, None)])
    text = (
        text[: text.rindex("<image>") + len("<image>")]
        if fam.name == "llava"
        else text[: text.rindex("<|vision_end|>")]
    )
    ids = fam.prompt_ids(text, [image])
    ((start, end),) = fam.image_runs(ids)
    assert end == len(ids) and end - start > 1
    first = served.generate(text, [image])
    served.check(text, [image], first, teacher_forced=True)
    repeat = served.generate(text, [image])
    assert repeat.prompt_cache_len == len(ids) - 1
    served.check(text, [image], repeat, teacher_forced=True)
    # Another question after the same image reuses the whole image (the tree holds the first answer's path).
    longer = fam.chat([("What is it?", 1, None)])
    expected = served.expected_reuse(longer, [image])
    assert expected >= end
    answer = served.generate(longer, [image])
    assert answer.prompt_cache_len == expected
    served.check(longer, [image], answer)
    served.check_tree()


def test_three_turn_chat_with_two_images(served):
    """Each turn's prompt is the previous turn's prompt, the server's answer TEXT, and a new question (an image
    with the first two), as a chat client builds it; each reuses at least the whole previous prompt."""
    fam = served.family
    images = [picture(96, 64, seed=301), picture(64, 112, seed=302)]
    questions = [("Describe the first picture.", 1), ("And this one, what differs?", 1), ("Which one is brighter?", 0)]
    turns: list[tuple[str, int, str | None]] = []
    prev_len = 0
    for k, (question, n_images) in enumerate(questions):
        turns.append((question, n_images, None))
        text, used = fam.chat(turns), images[: sum(n for _, n, _ in turns)]
        expected = served.expected_reuse(text, used)
        answer = served.generate(text, used)
        assert answer.prompt_cache_len == expected, f"turn {k + 1}"
        assert answer.prompt_cache_len >= prev_len, f"turn {k + 1} does not reuse the whole previous prompt"
        served.check(text, used, answer)
        prev_len = answer.prompt_tokens
        turns[-1] = (question, n_images, answer.text)
    served.check_tree()


def test_concurrent_requests_sharing_a_prefix(served):
    """Six requests with one long system text and one new image, differing only in the question, arrive together
    (they all wait for the image's encoding); then six more with new questions all reuse the shared prefix."""
    fam = served.family
    image = picture(112, 84, seed=401)
    waves = [[f"Question {k} of {w}: what is in the picture, number {k}?" for k in range(6)] for w in ("one", "two")]
    for wave in waves:
        jobs = [(fam.chat([(q, 1, None)], system=LONG_SYSTEM), [image]) for q in wave]
        answers = served.generate_concurrently(jobs)
        for (text, images), answer in zip(jobs, answers, strict=True):
            served.check(text, images, answer)
        ids = [fam.prompt_ids(text, images) for text, images in jobs]
        shared = min(common_len(p, ids[0]) for p in ids[1:])
        ((_, end),) = fam.image_runs(ids[0])
        assert shared > end
        if wave is waves[1]:
            assert all(a.prompt_cache_len >= shared for a in answers), [a.prompt_cache_len for a in answers]
    served.check_tree()


# ---------------------------------------------------------------------------------- servers of their own


def test_server_with_the_cache_disabled(tmp_path):
    """--disable_dynamic_prompt_cache: the same answers (HF's), nothing reused, nothing held."""
    family = Family("qwen2_vl", build("qwen2_vl", tmp_path / "qwen2_vl"))
    srv = ServerProcess(family.model_dir, str(tmp_path / "server.log"), "--max_total_token_num", "2048",
                        "--enable_multimodal", "--disable_dynamic_prompt_cache")  # fmt: skip
    try:
        srv.wait_healthy()
        image = picture(120, 90, seed=501)
        jobs = [(family.chat([(q, 1, None)]), [image]) for q in ("What color is it?", "What color is the sky?")]
        for text, images in jobs * 2:
            answer = post(srv, text, images)
            assert answer.prompt_cache_len == 0
            assert answer.ids == family.hf(text, images)
        assert srv.wait_metric(USED, lambda v: v == 0) == 0
        metrics = srv.metrics()
        assert metrics[HITS] == 0 and metrics[TREE] == 0
    finally:
        srv.stop_cleanly()


ENCODED, SKIPPED = "mmserve_images_encoded_total", "mmserve_images_encode_skipped_total"


@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_an_image_evicted_from_the_embedding_cache_is_not_encoded_when_the_prefix_cache_covers_it(name, tmp_path):
    """An embedding cache of one image: a follow-up question about an image that has left it since is answered
    from the prefix cache without running the image through the tower again (equal to HF all the same); the same
    image after another text is encoded again, since nothing covers it; nothing is left held."""
    family = Family(name, build(name, tmp_path / name))
    srv = ServerProcess(family.model_dir, str(tmp_path / "server.log"), "--max_total_token_num", str(KV_SLOTS),
                        "--enable_multimodal", "--cache_capacity", "1")  # fmt: skip
    try:
        srv.wait_healthy()
        image, other = picture(120, 90, seed=701), picture(90, 120, seed=702)
        first = family.chat([("Look closely at this picture. What color is it?", 1, None)])
        post(srv, first, [image])
        post(srv, family.chat([("And this one?", 1, None)]), [other])  # evicts `image` from the embedding cache
        assert srv.wait_metric(ENCODED, lambda v: v == 2) == 2
        follow_up = family.chat([("Look closely at this picture. How many objects are there?", 1, None)])
        ids = family.prompt_ids(follow_up, [image])
        ((_, end),) = family.image_runs(ids)
        answer = post(srv, follow_up, [image])
        assert answer.prompt_cache_len > end - 1  # the KV reached past the image...
        assert srv.metrics()[ENCODED] == 2  # ...so it was not encoded
        assert srv.wait_metric(SKIPPED, lambda v: v == 1) == 1
        assert answer.ids == family.hf(follow_up, [image])

        elsewhere = family.chat([("Look closely at this picture. How many objects are there?", 1, None)],
                                system="Answer in one word.")  # fmt: skip
        answer = post(srv, elsewhere, [image])
        assert answer.prompt_cache_len < family.image_runs(family.prompt_ids(elsewhere, [image]))[0][0] + 1
        assert srv.wait_metric(ENCODED, lambda v: v == 3) == 3  # the router asked for it
        assert srv.metrics()[SKIPPED] == 1
        assert answer.ids == family.hf(elsewhere, [image])
        assert srv.wait_metric(USED, lambda v: v == 0) == 0
        assert srv.wait_metric("mmserve_embed_cache_items_in_use", lambda v: v == 0) == 0
    finally:
        srv.stop_cleanly()


EVICT_SLOTS = 256  # about twice the longest request of the load below


def test_eviction_under_random_load(tmp_path):
    """A small KV cache, a random load (images and text, cache on and off, random lengths, some streams the client
    drops after the first token) with more distinct prefixes than the cache holds, prefilled in small chunks: every
    answer is right, no slot leaks, and afterwards a request needing every slot but one gets through."""
    family = Family("qwen2_vl", build("qwen2_vl", tmp_path / "qwen2_vl"))
    srv = ServerProcess(family.model_dir, str(tmp_path / "server.log"), "--max_total_token_num", str(EVICT_SLOTS),
                        "--chunked_prefill_size", "48", "--enable_multimodal")  # fmt: skip
    images = [picture(160, 120, seed=601), picture(120, 160, seed=602), picture(84, 84, seed=603)]  # 25, 25, 10
    a, b, c = images
    questions = ["What is it?", "Describe the colors.", "Count the shapes, please.", "Is it a photo?"]
    hello = [("Hello there, I have a few pictures for you.", 0, "Sure, show me the pictures and ask away.")]
    spec = [([], [a], 0), ([], [a], 1), ([], [b], 0), ([], [a, b], 2), ([], [], 3), (hello, [c], 1), (hello, [a], 3),
            (hello, [], 0), ([], [b, c], 2), (hello, [b], 2)]  # fmt: skip
    combos = [(family.chat(history + [(questions[q], len(ims), None)]), ims) for history, ims, q in spec]
    rng = random.Random(7)
    try:
        srv.wait_healthy()
        refs = [post(srv, text, ims, 12, cache=False).ids for text, ims in combos]
        for (text, ims), ref in zip(combos, refs, strict=True):
            assert ref == family.hf(text, ims, 12)
        assert max(len(family.prompt_ids(*c)) for c in combos) + 12 <= EVICT_SLOTS // 2

        load = [(rng.randrange(len(combos)), rng.randint(1, 12), rng.random() < 0.25, rng.random() < 0.12)
                for _ in range(30)]  # fmt: skip

        def run(job):
            combo, max_new, cache_off, drop = job
            text, ims = combos[combo]
            if not drop:
                answer = post(srv, text, ims, max_new, cache=not cache_off)
                assert answer.ids == refs[combo][:max_new], job
                assert (
                    answer.prompt_cache_len == 0 if cache_off else 0 <= answer.prompt_cache_len < answer.prompt_tokens
                )
                return answer, None
            body = request_body(text, ims, {"max_new_tokens": 12, "ignore_eos": True})
            with httpx.stream("POST", srv.url + "/generate_stream", json=body, timeout=300) as r:
                events = (json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:"))
                first = next(events)["token"]["id"]
            return None, first  # the client hung up: the server aborts the request

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(run, load))
        for (combo, *_), (_, first) in zip(load, results, strict=True):
            assert first is None or first == refs[combo][0]

        # More distinct prefixes went through than the cache holds: it must have evicted.
        tree = TreeModel()
        for (combo, _, cache_off, _), (answer, _) in zip(load, results, strict=True):
            if answer is not None and not cache_off:
                text, ims = combos[combo]
                tree.insert(family.cache_ids(family.prompt_ids(text, ims), ims) + answer.ids[:-1])
        assert tree.size > EVICT_SLOTS
        assert srv.metrics()[HITS] > 0

        assert srv.wait_metric(USED, lambda v: v == 0) == 0  # no request holds a slot: none leaked
        assert srv.metrics()[TREE] <= EVICT_SLOTS

        # The free count is exact: a request needing every slot but one is admitted (the tree gives all back).
        text, ims = family.chat([(" ".join(["Tell me everything about this picture."] * 10), 1, None)]), images[:1]
        max_new = EVICT_SLOTS - len(family.prompt_ids(text, ims))
        assert 8 <= max_new <= 64
        big = post(srv, text, ims, max_new)
        assert big.ids == post(srv, text, ims, max_new, cache=False).ids
        again = post(srv, *combos[0], 12)
        assert again.ids == refs[0]
        assert srv.wait_metric(USED, lambda v: v == 0) == 0
        assert srv.metrics()[TREE] <= EVICT_SLOTS
    finally:
        srv.stop_cleanly()
