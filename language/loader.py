"""Reading HF checkpoint folders: config.json and weights (safetensors or .bin pickles, single or sharded)."""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors import safe_open


def read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir} has no config.json: not a model folder")
    with open(path) as f:
        return json.load(f)


def architecture(raw_config: dict) -> str:
    archs = raw_config.get("architectures") or []
    if not archs:
        raise ValueError("config.json names no architectures")
    return archs[0]


def weight_files(model_dir: str) -> list[str]:
    """The weight files of a folder, preferring safetensors; an index file picks the shards."""
    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index = os.path.join(model_dir, index_name)
        if os.path.isfile(index):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(model_dir, s) for s in shards]
        if os.path.isfile(os.path.join(model_dir, single)):
            return [os.path.join(model_dir, single)]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not found:
        found = sorted(f for f in os.listdir(model_dir) if f.endswith(".bin") and f.startswith("pytorch_model"))
    if not found:
        raise FileNotFoundError(f"no safetensors or pytorch_model*.bin weights in {model_dir}")
    return [os.path.join(model_dir, f) for f in found]


# (checkpoint name, the tensor not read yet) -> the part to load: a tensor-parallel rank reads only its slice.
Take = Callable[[str, object], torch.Tensor]


def _take_all(name: str, view) -> torch.Tensor:
    return view[:]


def _read_shard(path: str, keep: Callable[[str], bool], take: Take = _take_all) -> Iterator[tuple[str, torch.Tensor]]:
    if path.endswith(".safetensors"):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if keep(name):  # tensors we skip (a vision tower, say) are never read
                    yield name, take(name, f.get_slice(name))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        yield from ((name, take(name, t)) for name, t in state.items() if keep(name))
        del state


def count_weights(model_dir: str, keep: Callable[[str], bool] = lambda name: True) -> int:
    """How many tensors iter_weights will yield (safetensors headers only; .bin shards are loaded to count)."""
    total = 0
    for path in weight_files(model_dir):
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt") as f:
                total += sum(1 for name in f.keys() if keep(name))  # noqa: SIM118
        else:
            total += sum(1 for name in torch.load(path, map_location="meta", weights_only=True) if keep(name))
    return total


def iter_weights(
    model_dir: str,
    keep: Callable[[str], bool] = lambda name: True,
    device: torch.device | None = None,
    workers: int = 8,
    take: Take = _take_all,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every kept tensor of every shard, in no particular order. Shards are read by parallel
    threads (reading and the host-to-device copy release the GIL), each tensor moved to `device` there, and handed
    over through a short queue so only a few tensors wait in memory at a time. `take(name, view)` picks the part
    of each tensor that is read (safetensors reads only that slice from the file)."""
    paths = weight_files(model_dir)
    if len(paths) == 1 or workers <= 1:
        for path in paths:
            for name, tensor in _read_shard(path, keep, take):
                yield name, tensor if device is None else tensor.to(device)
        return
    handoff: queue.Queue = queue.Queue(maxsize=2 * workers)
    done = object()
    stop = threading.Event()

    def read(path: str) -> None:
        try:
            for name, tensor in _read_shard(path, keep, take):
                if stop.is_set():
                    return
                handoff.put((name, tensor if device is None else tensor.to(device)))
        except BaseException as e:  # handed to the consumer, which raises it
            handoff.put(e)
        finally:
            handoff.put(done)

    with ThreadPoolExecutor(max_workers=min(workers, len(paths)), thread_name_prefix="weights") as pool:
        for path in paths:
            pool.submit(read, path)
        finished = 0
        try:
            while finished < len(paths):
                item = handoff.get()
                if item is done:
                    finished += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            stop.set()
            while finished < len(paths):  # let blocked readers finish so the pool can shut down
                if handoff.get() is done:
                    finished += 1


def checkpoint_dtype(raw_config: dict) -> torch.dtype:
    text = raw_config.get("text_config") or {}
    name = raw_config.get("torch_dtype") or raw_config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else torch.float16
