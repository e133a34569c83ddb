"""The visual process: in-process encoder steps, and the spawned process over zmq, on a tiny LLaVA checkpoint."""

import io
import pickle
import re
import signal
import threading
import time

import pytest
import torch
import zmq
from PIL import Image

from cache.shm_store import list_segments, new_prefix, read_embedding, unlink_all
from mmserve.launch.processes import spawn_child, stop_children, wait_ready
from mmserve.prep.visual_link import run_visual_process
from mmserve.testing.checkpoints.llava import build_llava_hf
from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
from visual import encoder as encoder_module
from visual.encoder import VisualEncoder, consecutive_view
from visual.messages import EncodeDone, EncodeFailed, EncodeJob, VisualReady
from visual.models.llava import LlavaVisionModel
from visual.models.qwen2_vl import Qwen2VLVisionModel
from visual.preprocess import PreprocessPool
from visual.process import VisualProcessConfig
from visual.stats import VisionStats, parse_stats_line
from visual.tower_turn import TowerTurn

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


@pytest.mark.parametrize("workers", [0, 1, "early"], ids=["threads", "processes", "processes-before-the-model"])
def test_encoder_steps_write_the_cache(model_dir, prefix, workers):
    if workers == "early":  # the pool of the family's preprocessor alone, started before the model is built
        pool = PreprocessPool.of_preprocessor(LlavaVisionModel.load_preprocessor(model_dir), 1)
    model = LlavaVisionModel.from_pretrained(model_dir, CPU, torch.float32)
    if workers != "early":
        pool = PreprocessPool(model, workers)
    encoder = VisualEncoder(model, pool, prefix, max_batch=2)
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
    stats = encoder.stats
    assert (stats.images, stats.failed) == (3, 1) and 2 <= stats.batches <= 3  # max_batch=2
    assert stats.decode_s > 0 and stats.preprocess_s > 0 and stats.tower_s > 0 and stats.write_s > 0
    assert stats.latency_s >= stats.tower_s + stats.write_s  # each image waited at least for its own batch
    for key, data in images.items():
        torch.testing.assert_close(read_embedding(prefix, key), expected_embeds(model, data))
    assert len(list_segments(prefix)) == 3


def test_qwen2_vl_batches_of_different_grids(prefix, tmp_path):
    """Variable-size images packed in one batch land in their own segments, equal to encoding each alone."""
    model = Qwen2VLVisionModel.from_pretrained(build_qwen2_vl(str(tmp_path)), CPU, torch.float32)
    encoder = VisualEncoder(model, PreprocessPool(model, 0), prefix, max_batch=4)
    images = {"a": png(150, 100, 0), "b": png(60, 200, 1), "c": png(333, 77, 2), "d": png(56, 56, 3)}
    for key, data in images.items():
        encoder.submit(EncodeJob(key, data))
    results = []
    while encoder.has_work():
        results += encoder.step(timeout_s=30)
    encoder.shutdown()
    assert sorted(r.key for r in results if isinstance(r, EncodeDone)) == sorted(images)
    for key, data in images.items():
        torch.testing.assert_close(read_embedding(prefix, key), expected_embeds(model, data), rtol=1e-5, atol=1e-5)


def test_batches_keep_to_the_patch_budget(prefix, tmp_path, caplog):
    """--visual_batch_max_patches: no tower batch runs over more patches than the budget (an image larger than it
    runs alone), and every image still lands in its segment, equal to encoding it alone."""
    model = Qwen2VLVisionModel.from_pretrained(build_qwen2_vl(str(tmp_path)), CPU, torch.float32)
    sizes = {"big": (336, 336), "a": (150, 100), "b": (112, 112), "c": (60, 200), "d": (56, 56), "e": (140, 84)}
    patches = {key: model.num_tokens(w, h) * model.merge_size**2 for key, (w, h) in sizes.items()}
    budget = 160  # "big" (256 patches) runs alone; the other five (276) need two batches at least
    assert patches["big"] > budget and sum(patches.values()) - patches["big"] > budget
    encoder = VisualEncoder(model, PreprocessPool(model, 0), prefix, max_batch=16, max_batch_patches=budget)
    images = {key: png(w, h, i) for i, (key, (w, h)) in enumerate(sizes.items())}
    for key, data in images.items():
        encoder.submit(EncodeJob(key, data))
    results = []
    with caplog.at_level("DEBUG", logger="visual.encoder"):
        while encoder.has_work():
            results += encoder.step(timeout_s=30)
    encoder.shutdown()
    lines = [re.search(r"images=(\d+) tokens=\d+ patches=(\d+)", r.getMessage()) for r in caplog.records]
    batches = [(int(m[1]), int(m[2])) for m in lines if m]  # (images, patches) of each tower batch
    assert sum(n for n, _ in batches) == len(images) and len(batches) >= 3
    assert all(p <= budget or n == 1 for n, p in batches), batches
    assert (1, patches["big"]) in batches
    assert sorted(r.key for r in results if isinstance(r, EncodeDone)) == sorted(images)
    for key, data in images.items():
        torch.testing.assert_close(read_embedding(prefix, key), expected_embeds(model, data), rtol=1e-5, atol=1e-5)


def _batch_sizes(caplog) -> list[int]:
    lines = [re.search(r"tower batch: .* images=(\d+)", r.getMessage()) for r in caplog.records]
    return [int(m[1]) for m in lines if m]


@pytest.mark.parametrize("wait_s, max_batch, batches", [(30.0, 4, [2]), (30.0, 1, [1, 1]), (0.0, 4, [1, 1])])
def test_a_batch_that_is_not_full_waits_for_images_still_preprocessing(model_dir, prefix, caplog, wait_s, max_batch,
                                                                        batches):  # fmt: skip
    """--visual_batch_wait_ms: a small image is ready long before a large one (one preprocessing thread, the large
    one's decode taking ~0.1-1 s): with a wait the two go through as one batch; a full batch, or no wait, goes at
    once."""
    model = LlavaVisionModel.from_pretrained(model_dir, CPU, torch.float32)
    encoder = VisualEncoder(model, PreprocessPool(model, 0), prefix, max_batch=max_batch, batch_wait_s=wait_s)
    images = {"small": png(40, 40, 0), "large": png(2400, 2400, 1)}
    for key, data in images.items():
        encoder.submit(EncodeJob(key, data))
    results = []
    with caplog.at_level("DEBUG", logger="visual.encoder"):
        while encoder.has_work():
            results += encoder.step(timeout_s=30)
    encoder.shutdown()
    assert _batch_sizes(caplog) == batches
    assert sorted(r.key for r in results if isinstance(r, EncodeDone)) == sorted(images)
    for key, data in images.items():
        torch.testing.assert_close(read_embedding(prefix, key), expected_embeds(model, data))


def _encoder_with_a_turn(model_dir, prefix, lookahead_tokens: int) -> VisualEncoder:
    """An encoder that reads the router's backlog (its segment created, as the visual process does on a GPU), with
    one 40 x 40 image (16 tokens) submitted."""
    model = LlavaVisionModel.from_pretrained(model_dir, CPU, torch.float32)
    turn = TowerTurn(prefix)
    turn.create()
    encoder = VisualEncoder(
        model, PreprocessPool(model, 0), prefix, max_batch=4, turn=turn, lookahead_tokens=lookahead_tokens
    )
    encoder.submit(EncodeJob("a", png(40, 40, 0)))
    return encoder


def _encode_all(encoder: VisualEncoder) -> list:
    results = []
    while encoder.has_work():
        results += encoder.step(timeout_s=30)
    encoder.shutdown()
    return results


def test_a_batch_is_held_while_the_lms_prompt_backlog_is_full(model_dir, prefix):
    """--tower_lookahead_tokens: while the router says that many prompt tokens wait for prefill, the next tower batch
    is held (the image is preprocessed meanwhile); once the backlog drops below it, the batch runs."""
    encoder, router_side = _encoder_with_a_turn(model_dir, prefix, 100), TowerTurn(prefix)
    router_side.publish_backlog(100)
    results: list = []
    stepping = threading.Thread(target=lambda: results.extend(encoder.step(timeout_s=30)))
    stepping.start()
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        router_side.publish_backlog(100)  # as the router does every loop turn (a silent router holds nothing back)
        time.sleep(0.01)
    assert stepping.is_alive() and not results  # held
    router_side.publish_backlog(99)
    stepping.join(timeout=30)
    encoder.shutdown()
    assert [r.key for r in results if isinstance(r, EncodeDone)] == ["a"]
    assert 0.2 < encoder.stats.held_s < 1  # (the hold starts once the image is preprocessed)


def test_a_batch_of_the_lookahead_or_more_is_not_held(model_dir, prefix):
    """A batch whose tokens reach --tower_lookahead_tokens (a long clip's) runs at once: holding it would leave the
    LM without prompts before it is out of the tower."""
    encoder = _encoder_with_a_turn(model_dir, prefix, 16)  # the image's 16 tokens
    TowerTurn(prefix).publish_backlog(10**6)
    results = _encode_all(encoder)
    assert [r.key for r in results if isinstance(r, EncodeDone)] == ["a"] and results[0].num_tokens == 16
    assert encoder.stats.held_s == 0


def test_a_backlog_that_does_not_shrink_holds_a_batch_for_a_second_at_most(model_dir, prefix, monkeypatch):
    """Prompts that wait for KV space keep the backlog full without being prefilled: the tower goes on after
    _MAX_HOLD_S."""
    monkeypatch.setattr(encoder_module, "_MAX_HOLD_S", 0.3)
    encoder = _encoder_with_a_turn(model_dir, prefix, 100)
    TowerTurn(prefix).publish_backlog(10**6)  # fresh for the whole hold (_BACKLOG_STALE_S is 1 s)
    results = _encode_all(encoder)
    assert [r.key for r in results if isinstance(r, EncodeDone)] == ["a"]
    assert 0.3 <= encoder.stats.held_s < 0.9


def test_encode_job_frames_round_trip():
    job = EncodeJob("key:ü", b"\x00\x01 image bytes")
    assert len(job.frames()) == 2 and EncodeJob.from_frames(job.frames()) == job
    # a video's sampling and a request's preprocessing options (InternVL's tile cap): a third frame, one or both
    video = EncodeJob("key", b"video bytes", {"fps": 2.0, "max_pixels": 12544})
    tiled = EncodeJob("key", b"bytes", options={"max_patches": 6})
    both = EncodeJob("key", b"bytes", {"fps": 2.0}, {"max_patches": 6})
    for params in (video, tiled, both):
        assert len(params.frames()) == 3 and EncodeJob.from_frames(params.frames()) == params
    with pytest.raises(ValueError, match="'video' and 'options'"):
        EncodeJob.from_frames([b"key", b"bytes", b'{"fps": 2.0}'])  # the sampling itself, not under "video"
    with pytest.raises(ValueError, match="JSON objects"):
        EncodeJob.from_frames([b"key", b"bytes", b'{"options": [6]}'])
    with pytest.raises(ValueError, match="2 or 3 frames"):
        EncodeJob.from_frames([b"only a key"])


def test_consecutive_view():
    flat = torch.arange(24.0).view(12, 2)
    parts = list(torch.split(flat, [3, 5, 4]))
    view = consecutive_view(parts)
    assert view is not None and view.data_ptr() == flat.data_ptr() and torch.equal(view, flat)
    stacked = torch.arange(24.0).view(3, 4, 2)
    assert torch.equal(consecutive_view(list(stacked.unbind(0))), stacked.view(12, 2))
    assert consecutive_view([parts[0], parts[2]]) is None  # a gap
    assert consecutive_view([parts[1], parts[0]]) is None  # out of order
    assert consecutive_view([torch.zeros(2, 2), torch.zeros(2, 2)]) is None  # separate storages


def test_stats_line_round_trip():
    stats = VisionStats()
    before = stats.copy()
    stats.add_batch(tower_s=0.1, write_s=0.02, decode_s=0.03, preprocess_s=0.05, latency_s=0.8, images=4)
    stats.add_batch(tower_s=0.3, write_s=0.02, decode_s=0.01, preprocess_s=0.03, latency_s=0.4, images=2)
    stats.held_s += 0.5
    line = "2024-01-01 INFO visual: " + stats.summary(before, elapsed_s=2.0)
    fields = parse_stats_line(line)
    assert fields == {
        "images": 6, "batches": 2, "images_per_batch": 3.0, "images_per_s": 3.0, "decode_ms": 6.7,
        "preprocess_ms": 13.3, "latency_ms": 200.0, "tower_ms": 200.0, "write_ms": 20.0, "busy": 0.22, "held": 0.25,
        "failed": 0,
    }  # fmt: skip
    assert parse_stats_line("router: 12 steps") is None


def test_visual_process_over_zmq_and_cleanup_after_kill(model_dir, prefix, tmp_path):
    cfg = VisualProcessConfig(
        model_dir=model_dir,
        jobs_addr=f"ipc://{tmp_path}/visual.sock",
        results_addr=f"ipc://{tmp_path}/http.sock",
        shm_prefix=prefix,
        device="cpu",
        data_type="auto",
        load_format="auto",
        log_level="info",
        num_preprocess_workers=1,
    )
    ctx = zmq.Context()
    results = ctx.socket(zmq.PULL)
    results.bind(cfg.results_addr)
    child = spawn_child("visual", run_visual_process, cfg)
    jobs = ctx.socket(zmq.PUSH)
    try:
        wait_ready([child], timeout_s=120)
        assert isinstance(child.info, VisualReady) and child.info.hidden_size == 64
        jobs.connect(cfg.jobs_addr)
        data = png(90, 40, 3)
        jobs.send(b"not a job")  # one frame: dropped with an error in the log, the process goes on
        jobs.send_multipart(EncodeJob("k1", data).frames())
        jobs.send_multipart(EncodeJob("k2", b"\x89PNG\r\n\x1a\n truncated").frames())
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
        left = list_segments(prefix)
        assert [n for n in left if "spare" not in n] == [prefix + "k1"]
        assert [n for n in left if "spare" in n]  # made ahead of the next image (visual/spare_segments.py)
        assert unlink_all(prefix) == len(left) and list_segments(prefix) == []
    finally:
        stop_children([child])
        jobs.close()  # (a socket left open would hang ctx.term() after a failed assertion)
        results.close()
        ctx.term()
