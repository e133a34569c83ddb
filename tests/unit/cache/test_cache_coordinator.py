import asyncio

import pytest
import torch

from cache.coordinator import CacheCoordinator, EncoderUnavailable, ImageEncodeError
from cache.index import CacheCapacityError
from cache.shm_store import list_segments, new_prefix, unlink_all, write_embedding
from visual.messages import EncodeDone, EncodeFailed


class FakeVisual:
    """Stands in for the visual process's queue: records jobs; the test decides when each finishes."""

    def __init__(self, prefix):
        self.prefix, self.jobs = prefix, []

    def send(self, job):
        self.jobs.append(job)

    def finish(self, coord, ok=True):
        while self.jobs:
            job = self.jobs.pop(0)
            if ok:
                write_embedding(self.prefix, job.key, torch.ones(2, 3))
                coord.on_result(EncodeDone(job.key, 2))
            else:
                coord.on_result(EncodeFailed(job.key, "cannot identify image file", bad_image=True))


@pytest.fixture
def prefix():
    p = new_prefix()
    yield p
    unlink_all(p)


def test_concurrent_requests_share_one_encode(prefix):
    async def main():
        visual = FakeVisual(prefix)
        coord = CacheCoordinator(4, prefix, visual.send)
        tasks = [asyncio.create_task(coord.acquire([("img", b"bytes")])) for _ in range(6)]
        await asyncio.sleep(0)
        assert len(visual.jobs) == 1  # six requests, one encode
        visual.finish(coord)
        results = await asyncio.gather(*tasks)
        assert all(entries[0].key == "img" for entries in results)
        assert coord.metrics() == {
            "mmserve_images_encoded_total": 1,
            "mmserve_embed_cache_hits_total": 5,
            "mmserve_embed_cache_items": 1,
            "mmserve_embed_cache_items_in_use": 1,
        }
        for entries in results:
            coord.release(entries)
        again = await coord.acquire([("img", b"bytes")])  # ready: no new job
        assert visual.jobs == [] and coord.metrics()["mmserve_images_encoded_total"] == 1
        coord.release(again)

    asyncio.run(main())


def test_requests_wait_for_room_and_evicted_segments_are_unlinked(prefix):
    async def main():
        visual = FakeVisual(prefix)
        coord = CacheCoordinator(2, prefix, visual.send)

        async def request(i):
            entries = await coord.acquire([(f"k{i}", b"x")])
            await asyncio.sleep(0.01)
            coord.release(entries)

        tasks = [asyncio.create_task(request(i)) for i in range(10)]
        for _ in range(200):
            visual.finish(coord)
            await asyncio.sleep(0.002)
            if all(t.done() for t in tasks):
                break
        await asyncio.gather(*tasks)
        assert coord.images_encoded == 10
        assert len(coord.index) == 2 and len(list_segments(prefix)) == 2

    asyncio.run(main())


def test_capacity_error_and_failed_encode_hold_nothing(prefix):
    async def main():
        visual = FakeVisual(prefix)
        coord = CacheCoordinator(2, prefix, visual.send)
        with pytest.raises(CacheCapacityError):
            await coord.acquire([("a", b""), ("b", b""), ("c", b"")])
        task = asyncio.create_task(coord.acquire([("a", b"x"), ("b", b"y")]))
        await asyncio.sleep(0)
        visual.finish(coord, ok=False)
        with pytest.raises(ImageEncodeError) as err:
            await task
        assert err.value.bad_image
        assert len(coord.index) == 0
        retry = asyncio.create_task(coord.acquire([("a", b"x")]))
        await asyncio.sleep(0)
        assert [j.key for j in visual.jobs] == ["a"]  # a failed key is encoded again on the next request
        visual.finish(coord)
        coord.release(await retry)

    asyncio.run(main())


def test_cancelled_waiter_releases(prefix):
    async def main():
        visual = FakeVisual(prefix)
        coord = CacheCoordinator(1, prefix, visual.send)
        task = asyncio.create_task(coord.acquire([("a", b"x")]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert coord.index.lookup("a").refs == 0
        visual.finish(coord)  # the encode still lands; then the entry is evictable
        task = asyncio.create_task(coord.acquire([("b", b"y")]))
        await asyncio.sleep(0)
        visual.finish(coord)
        coord.release(await task)
        assert coord.index.lookup("a") is None and list_segments(prefix) == [prefix + "b"]

    asyncio.run(main())


def test_a_result_for_a_later_image_while_waiting_on_an_earlier_one(prefix):
    async def main():
        visual = FakeVisual(prefix)
        coord = CacheCoordinator(4, prefix, visual.send)
        task = asyncio.create_task(coord.acquire([("a", b"x"), ("b", b"y")]))
        await asyncio.sleep(0)
        job_a, job_b = visual.jobs
        coord.on_result(EncodeFailed(job_b.key, "broken", bad_image=True))  # b answers first, while a is awaited
        write_embedding(prefix, "a", torch.ones(2, 3))
        coord.on_result(EncodeDone("a", 2))
        with pytest.raises(ImageEncodeError):
            await task
        assert coord.index.lookup("a").refs == 0

    asyncio.run(main())


def test_encoder_down_fails_waiters_refuses_new_images_and_serves_cached_ones(prefix):
    async def main():
        visual = FakeVisual(prefix)
        coord = CacheCoordinator(4, prefix, visual.send)
        cached = asyncio.create_task(coord.acquire([("c", b"z")]))
        await asyncio.sleep(0)
        visual.finish(coord)
        coord.release(await cached)
        waiting = asyncio.create_task(coord.acquire([("c", None), ("a", b"x")]))
        await asyncio.sleep(0)
        visual.jobs.clear()  # lost with the process
        write_embedding(prefix, "a", torch.ones(1, 3))  # half-written by the process that died
        coord.encoder_down("the visual process exited (code -9)")
        with pytest.raises(EncoderUnavailable, match="code -9"):
            await waiting
        assert coord.index.lookup("a") is None and coord.index.lookup("c").refs == 0
        assert list_segments(prefix) == [prefix + "c"]  # the dead process's partial segment is gone
        with pytest.raises(EncoderUnavailable):
            await coord.acquire([("b", b"y")])
        assert visual.jobs == [] and coord.index.lookup("b") is None
        entries = await coord.acquire([("c", None)])  # cached: served while the encoder is down
        coord.release(entries)
        coord.encoder_up()
        task = asyncio.create_task(coord.acquire([("b", b"y")]))
        await asyncio.sleep(0)
        visual.finish(coord)
        coord.release(await task)
        assert coord.metrics()["mmserve_embed_cache_items_in_use"] == 0

    asyncio.run(main())


def test_a_result_for_a_dropped_entry_unlinks_its_segment(prefix):
    async def main():
        visual = FakeVisual(prefix)
        coord = CacheCoordinator(4, prefix, visual.send)
        task = asyncio.create_task(coord.acquire([("a", b"x")]))
        await asyncio.sleep(0)
        coord.encoder_down("gone")
        with pytest.raises(EncoderUnavailable):
            await task
        visual.finish(coord)  # an answer that was already on its way
        assert coord.index.lookup("a") is None and list_segments(prefix) == []

    asyncio.run(main())
