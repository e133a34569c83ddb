"""Image embeddings on their way to the device: the prefetch into pinned memory and the upload of the parts."""

from __future__ import annotations

import time

import pytest
import torch

from language.embed_upload import EmbedUpload
from language.request import MultimodalItem

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cpu_upload_is_the_concatenation_in_the_lm_dtype() -> None:
    parts = [torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)]
    upload = EmbedUpload(torch.device("cpu"))
    item = MultimodalItem(0, parts[0])
    upload.prefetch([item])  # nothing to pin for on CPU
    assert item.embeds is parts[0]
    out = upload.to_device(parts, torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, torch.cat(parts).float())


def _prefetched(items: list[MultimodalItem], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(item.embeds.is_pinned() for item in items):
            return True
        time.sleep(0.01)
    return False


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("prefetch", [True, False])  # pinned copies, or the gather through the staging buffer
def test_gpu_upload_equals_the_parts(prefetch: bool) -> None:
    device = torch.device("cuda")
    sources = [torch.randn(n, 64, dtype=torch.bfloat16) for n in (144, 256, 1024)]
    items = [MultimodalItem(0, src) for src in sources]
    upload = EmbedUpload(device)
    if prefetch:
        upload.prefetch(items)
        assert _prefetched(items)
        assert all(torch.equal(item.embeds, src) for item, src in zip(items, sources, strict=True))
    parts = [items[0].embeds, items[1].embeds[100:], items[2].embeds[:512]]  # chunked prefill takes slices
    out = upload.to_device(parts, torch.bfloat16)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.cat([sources[0], sources[1][100:], sources[2][:512]]))
