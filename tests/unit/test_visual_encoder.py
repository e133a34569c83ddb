"""The visual process: in-process encoder steps, and the spawned process over zmq, on a tiny LLaVA checkpoint."""

import io
import pickle
import signal

import pytest
import torch
import zmq
from PIL import Image

from cache.shm_store import list_segments, new_prefix, read_embedding, unlink_all
from mmserve.checkpoints.llava import build_llava_hf
from mmserve.processes import spawn_child, stop_children, wait_ready
from visual.encoder import VisualEncoder
from visual.messages import EncodeDone, EncodeFailed, EncodeJob, VisualReady
from visual.models.llava import LlavaVisionModel
from visual.preprocess import PreprocessPool
from visual.process import VisualProcessConfig, run_visual_process

CPU = torch.device("cpu")


def png(width, height, seed) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_llava_hf(str(tmp_path_factory.mktemp("llava_hf")))


@pytest.fixture
def prefix():
    p = new_prefix()
    yield p
    unlink_all(p)


def expected_embeds(model, data: bytes) -> torch.Tensor:
    return model.encode([model.preprocess(Image.open(io.BytesIO(data)))])[0]


@pytest.mark.parametrize("workers", [0, 1], ids=["threads", "processes"])
def test_encoder_steps_write_the_cache(model_dir, prefix, workers):
    model = LlavaVisionModel.from_pretrained(model_dir, CPU, torch.float32)
    encoder = VisualEncoder(model, PreprocessPool(model, workers), prefix, max_batch=2)
    images = {"a": png(80, 50, 0), "b": png(30, 60, 1), "c": png(56, 56, 2)}
    for key, data in images.items():
        encoder.submit(EncodeJob(key, data))
    encoder.submit(EncodeJob("bad", b"definitely not an image"))
    results = []
    while encoder.has_work():
        results += encoder.step(timeout_s=30)
    encoder.shutdown()
    done = {r.key: r for r in results if isinstance(r, EncodeDone)}
    failed = [r for r in results if isinstance(r, EncodeFailed)]
    assert sorted(done) == ["a", "b", "c"] and all(r.num_tokens == 16 for r in done.values())
    assert [f.key for f in failed] == ["bad"] and failed[0].bad_image and "not a readable image" in failed[0].error
    assert encoder.images_encoded == 3
    for key, data in images.items():
        torch.testing.assert_close(read_embedding(prefix, key), expected_embeds(model, data))
    assert len(list_segments(prefix)) == 3


def test_visual_process_over_zmq_and_cleanup_after_kill(model_dir, prefix, tmp_path):
    cfg = VisualProcessConfig(
        model_dir=model_dir,
        jobs_addr=f"ipc://{tmp_path}/visual.sock",
        results_addr=f"ipc://{tmp_path}/http.sock",
        shm_prefix=prefix,
        device="cpu",
        num_preprocess_workers=1,
    )
    ctx = zmq.Context()
    results = ctx.socket(zmq.PULL)
    results.bind(cfg.results_addr)
    child = spawn_child("visual", run_visual_process, cfg)
    try:
        wait_ready([child], timeout_s=120)
        assert isinstance(child.info, VisualReady) and child.info.hidden_size == 64
        jobs = ctx.socket(zmq.PUSH)
        jobs.connect(cfg.jobs_addr)
        data = png(90, 40, 3)
        jobs.send(pickle.dumps(EncodeJob("k1", data)))
        jobs.send(pickle.dumps(EncodeJob("k2", b"\x89PNG\r\n\x1a\n truncated")))
        got = {}
        while len(got) < 2:
            assert results.poll(60_000), "no answer from the visual process"
            msg = pickle.loads(results.recv())
            got[msg.key] = msg
        assert isinstance(got["k1"], EncodeDone) and isinstance(got["k2"], EncodeFailed)
        model = LlavaVisionModel.from_pretrained(model_dir, CPU, torch.float32)
        torch.testing.assert_close(read_embedding(prefix, "k1"), expected_embeds(model, data))
        child.process.kill()  # a crash: the parent still removes its segments by prefix
        child.process.join(30)
        assert child.exitcode == -signal.SIGKILL
        assert list_segments(prefix) == [prefix + "k1"]
        assert unlink_all(prefix) == 1 and list_segments(prefix) == []
        jobs.close()
    finally:
        stop_children([child])
        results.close()
        ctx.term()
