"""The HTTP side of a multimodal request end to end, in one process: image loading, prompt expansion, the cache
coordinator, and a real visual encoder (tiny LLaVA) answering its jobs."""

import asyncio
import base64
import io

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer

from cache.coordinator import CacheCoordinator
from cache.shm_store import list_segments, new_prefix, read_embedding, unlink_all
from language.sampling_params import SamplingParams
from mmserve.http.protocol import BadRequest, GenerateInput
from mmserve.prep.multimodal.llava import LlavaPromptProcessor
from mmserve.prep.multimodal.preparer import MultimodalPreparer
from mmserve.prep.tokenization import Limits, MultimodalInput, RequestPreparer
from mmserve.testing.checkpoints.llava import build_llava_hf
from visual.encoder import VisualEncoder
from visual.models.llava import LlavaVisionModel
from visual.options import VisualOptions
from visual.preprocess import PreprocessPool


def image_item(width, height, seed) -> dict:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="PNG")
    return {"type": "base64", "data": base64.b64encode(buf.getvalue()).decode()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_llava_hf(str(tmp_path_factory.mktemp("llava_hf")))


@pytest.fixture(scope="module")
def vision(model_dir):
    return LlavaVisionModel.from_pretrained(model_dir, torch.device("cpu"), torch.float32)


class Harness:
    """The preparer wired as the server wires it, with the visual process's work done by an in-process encoder."""

    def __init__(self, model_dir, vision, capacity):
        self.prefix = new_prefix()
        self.encoder = VisualEncoder(
            vision, PreprocessPool(vision, 0), self.prefix, VisualOptions().visual_infer_batch_size
        )
        self.coordinator = CacheCoordinator(capacity, self.prefix, self.encoder.submit)
        processor = LlavaPromptProcessor.from_pretrained(model_dir, AutoTokenizer.from_pretrained(model_dir))
        self.preparer = MultimodalPreparer(
            processor, self.coordinator, vision.cache_salt, check_size=processor.check_image_size
        )

    async def pump(self):
        """What the server's task reading the visual results queue does."""
        while True:
            for result in await asyncio.to_thread(self.encoder.step, 0.01):
                self.coordinator.on_result(result)
            await asyncio.sleep(0.001)

    def close(self):
        self.encoder.shutdown()
        unlink_all(self.prefix)


async def run_sync(fn, *args):
    return await asyncio.to_thread(fn, *args)


def run(model_dir, vision, capacity, body):
    async def main():
        h = Harness(model_dir, vision, capacity)
        pump = asyncio.create_task(h.pump())
        try:
            return await body(h)
        finally:
            pump.cancel()
            h.close()

    return asyncio.run(main())


PROMPT = "USER: <image>\n<image>\nCompare them. ASSISTANT:"


def test_prepare_two_images(model_dir, vision):
    items = [image_item(80, 50, 0), image_item(40, 70, 1)]

    async def body(h):
        prepared = await h.preparer.prepare("r1", MultimodalInput(PROMPT, {"images": items}), run_sync)
        hf = AutoProcessor.from_pretrained(model_dir)
        images = [Image.open(io.BytesIO(base64.b64decode(i["data"]))) for i in items]
        assert prepared.prompt_ids == hf(images=images, text=PROMPT)["input_ids"][0]
        assert not prepared.wait_for_images
        assert [(r.offset, r.num_tokens) for r in prepared.images] == [(4, 16), (21, 16)]
        for ref, image in zip(prepared.images, images, strict=True):
            want = vision.encode([vision.preprocess(image)])[0]
            torch.testing.assert_close(read_embedding(h.prefix, ref.key), want)
        h.preparer.release("r1")
        assert all(e.refs == 0 for e in h.coordinator.index._entries.values())
        text_only = await h.preparer.prepare("r2", MultimodalInput("USER: hi ASSISTANT:", {}), run_sync)
        assert text_only.images == () and text_only.prompt_ids[0] == 1

    run(model_dir, vision, 4, body)


def test_stop_ids_are_looked_up_before_the_images(model_dir, vision):
    """A stop sequence that is one special token becomes a stop id, looked up in the tokenizer pool before the
    request's images are prepared (after them, a whole tower batch's requests would queue for the two-thread pool
    at once); a request without stop sequences skips the lookup."""
    calls: list[str] = []

    async def recording(fn, *args):
        calls.append(getattr(fn, "__name__", type(fn).__name__))
        return await run_sync(fn, *args)

    async def body(h):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        preparer = RequestPreparer(tokenizer, Limits(4096), h.preparer)
        images = {"images": [image_item(48, 40, 7)]}
        stops = SamplingParams(max_new_tokens=2, stop_sequences=("</s>", "hello"))
        out = await preparer.prepare("s1", GenerateInput("USER: <image>\nhi", stops, images), recording)
        assert out.params.stop_token_ids == (tokenizer.convert_tokens_to_ids("</s>"),)  # "hello" stays text
        assert calls[0] == "_with_stop_token_ids" and len(calls) > 1, calls  # then the image side's own work
        preparer.release("s1")
        calls.clear()
        plain = SamplingParams(max_new_tokens=2)
        out = await preparer.prepare("s2", GenerateInput("USER: <image>\nhi", plain, images), recording)
        assert out.params.stop_token_ids == () and "_with_stop_token_ids" not in calls and calls, calls
        preparer.release("s2")

    run(model_dir, vision, 4, body)


def test_same_image_in_concurrent_requests_is_encoded_once(model_dir, vision):
    item = image_item(64, 32, 5)

    async def body(h):
        prepared = await asyncio.gather(
            *(
                h.preparer.prepare(f"r{i}", MultimodalInput("USER: <image>\nhi", {"images": [item]}), run_sync)
                for i in range(6)
            )
        )
        assert len({p.images[0].key for p in prepared}) == 1
        again = await h.preparer.prepare("r6", MultimodalInput("USER: <image>\nagain", {"images": [item]}), run_sync)
        metrics = h.coordinator.metrics()
        assert metrics["mmserve_images_encoded_total"] == 1 and h.encoder.images_encoded == 1
        assert metrics["mmserve_embed_cache_hits_total"] == 6
        for i in range(7):
            h.preparer.release(f"r{i}")
        assert again.images[0].key == prepared[0].images[0].key

    run(model_dir, vision, 4, body)


def test_many_distinct_images_through_a_small_cache(model_dir, vision):
    async def body(h):
        async def one(i):
            request = MultimodalInput("<image> describe", {"images": [image_item(20, 30, 100 + i)]})
            prepared = await h.preparer.prepare(f"r{i}", request, run_sync)
            await asyncio.sleep(0.01)
            h.preparer.release(f"r{i}")
            return prepared

        done = await asyncio.gather(*(one(i) for i in range(12)))
        assert len({p.images[0].key for p in done}) == 12
        entries = [n for n in list_segments(h.prefix) if "spare" not in n]  # not the segments made ahead for writes
        assert len(h.coordinator.index) <= 4 and len(entries) <= 4  # evicted entries are unlinked

    run(model_dir, vision, 4, body)


@pytest.mark.parametrize(
    "prompt, images, message",
    [
        ("USER: <image>\n<image>\nhi", [image_item(8, 8, 0)], "2 image placeholder"),
        ("USER: hi", [image_item(8, 8, 0)], "0 image placeholder"),
        ("USER: <image> hi", [{"type": "base64", "data": "%%%"}], r"images\[0\].*malformed base64"),
        ("USER: <image> hi", [{"type": "url", "data": "http://127.0.0.1:1/x.png"}], "non-public address"),
        ("<image><image><image>", [image_item(8, 8, i) for i in range(3)], "at most 2"),
    ],
)
def test_client_errors_are_400_and_hold_nothing(model_dir, vision, prompt, images, message):
    async def body(h):
        with pytest.raises(BadRequest, match=message) as err:
            await h.preparer.prepare("bad", MultimodalInput(prompt, {"images": images}), run_sync)
        assert err.value.status == 400
        assert all(e.refs == 0 for e in h.coordinator.index._entries.values())
        h.preparer.release("bad")  # the server calls it on every failure: must be harmless

    run(model_dir, vision, 2, body)


def test_an_image_seen_before_is_not_decoded_again():
    from mmserve.prep.multimodal.image_io import ImagePolicy
    from mmserve.prep.multimodal.preparer import SeenImages, load_and_key

    item = image_item(37, 21, 9)
    seen = SeenImages(capacity=8)
    first, key = load_and_key(item, ImagePolicy(), "salt", seen)
    again, key_again = load_and_key(item, ImagePolicy(), "salt", seen)
    assert first.data is not None and again.data is None and again.image is None  # neither base64 nor PNG decoded
    assert key == key_again and (again.width, again.height) == (first.width, first.height) == (37, 21)
    wrapped = {"type": "base64", "data": "data:image/png;base64," + item["data"]}  # same bytes, other text
    other, key_wrapped = load_and_key(wrapped, ImagePolicy(), "salt", seen)
    assert key_wrapped == key and other.data is not None and other.image is None  # bytes decoded, image not


def test_a_seen_image_evicted_from_the_cache_is_decoded_and_encoded_again(model_dir, vision):
    seen_item = image_item(24, 24, 40)

    async def body(h):
        first = await h.preparer.prepare("a", MultimodalInput("USER: <image>\nhi", {"images": [seen_item]}), run_sync)
        h.preparer.release("a")
        for i in range(2):  # a cache of 2: two other images push the first one out
            await h.preparer.prepare(
                f"o{i}", MultimodalInput("USER: <image>\nhi", {"images": [image_item(24, 24, 50 + i)]}), run_sync
            )
            h.preparer.release(f"o{i}")
        assert h.coordinator.index.lookup(first.images[0].key) is None
        again = await h.preparer.prepare("b", MultimodalInput("USER: <image>\nhi", {"images": [seen_item]}), run_sync)
        assert again.images[0].key == first.images[0].key and h.encoder.images_encoded == 4
        torch.testing.assert_close(read_embedding(h.prefix, again.images[0].key),
                                   vision.encode([vision.preprocess(Image.open(io.BytesIO(
                                       base64.b64decode(seen_item["data"]))))])[0])  # fmt: skip
        h.preparer.release("b")

    run(model_dir, vision, 2, body)
