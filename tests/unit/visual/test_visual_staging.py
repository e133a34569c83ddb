"""The visual process's bulk host copies: the batch gather and the copy threads."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from visual.staging import gather_rows, in_parallel


@pytest.mark.parametrize("rows", [[3, 1, 4], [700, 900, 1100, 500]])  # 21 KiB and 12 MiB: inline and on the threads
def test_gather_rows_lays_the_tensors_one_after_another(rows: list[int]) -> None:
    parts = [torch.randn(n, 1176) for n in rows]
    with torch.inference_mode():  # as in the tower's batch: an inference tensor, which the copy threads write into
        out = torch.empty(sum(rows), 1176)
        assert gather_rows(out, parts) is out
    assert torch.equal(out, torch.cat(parts))


def test_in_parallel_runs_every_item_and_reraises() -> None:
    seen, threads = [], set()

    def record(i: int) -> None:
        seen.append(i)
        threads.add(threading.current_thread().name)

    in_parallel(record, range(32))
    assert sorted(seen) == list(range(32))
    assert all(name.startswith("visual-copy") for name in threads)

    ended = []

    def fail(i: int) -> None:
        if i == 1:
            raise OSError("no space left in /dev/shm")
        time.sleep(0.05)
        ended.append(i)

    with pytest.raises(OSError, match="no space"):
        in_parallel(fail, range(8))
    assert sorted(ended) == [0, 2, 3, 4, 5, 6, 7]  # every other copy had ended when the error came out
