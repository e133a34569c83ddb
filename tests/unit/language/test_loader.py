"""Reading sharded checkpoints: every kept tensor exactly once, skipped ones never read, errors surface."""

import pytest
import torch
from safetensors.torch import save_file

from language.loader import iter_weights


def _shards(tmp_path, n: int) -> dict[str, torch.Tensor]:
    everything = {}
    for s in range(n):
        tensors = {f"s{s}.t{i}": torch.full((3, 2), float(10 * s + i)) for i in range(5)}
        save_file(tensors, str(tmp_path / f"model-{s:05d}-of-{n:05d}.safetensors"))
        everything.update(tensors)
    return everything


@pytest.mark.parametrize("workers", [1, 3])
def test_every_kept_tensor_once_whatever_the_threads(tmp_path, workers):
    everything = _shards(tmp_path, 4)
    got = dict(iter_weights(str(tmp_path), keep=lambda name: not name.endswith("t3"), workers=workers))
    assert sorted(got) == sorted(n for n in everything if not n.endswith("t3"))
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, everything[name])


def test_a_broken_shard_raises(tmp_path):
    _shards(tmp_path, 3)
    (tmp_path / "model-00001-of-00003.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Exception):  # noqa: B017 (whatever safetensors raises, it reaches the caller)
        list(iter_weights(str(tmp_path), workers=3))


def test_count_matches_what_is_read(tmp_path):
    from language.loader import count_weights

    _shards(tmp_path, 3)
    keep = lambda name: name.startswith("s1")  # noqa: E731
    assert count_weights(str(tmp_path), keep) == len(list(iter_weights(str(tmp_path), keep=keep))) == 5


def test_progress_logs_when_not_on_a_terminal(caplog):
    import logging

    from language.progress import progress

    log = logging.getLogger("progress-test")
    with caplog.at_level(logging.INFO, logger="progress-test"):
        assert list(progress(range(7), 7, "loading weights", log)) == list(range(7))
    assert "loading weights: 7/7 done" in caplog.text
