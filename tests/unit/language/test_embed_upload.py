"""Image embeddings on their way to the device: the parts of a prompt step, gathered and uploaded."""

from __future__ import annotations

import pytest
import torch

from language.embed_upload import EmbedUpload


def test_cpu_upload_is_the_concatenation_in_the_lm_dtype() -> None:
    parts = [torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)]
    out = EmbedUpload(torch.device("cpu")).to_device(parts, torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, torch.cat(parts).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_upload_equals_the_parts_step_after_step() -> None:
    upload = EmbedUpload(torch.device("cuda"))
    sources = [torch.randn(n, 64, dtype=torch.bfloat16) for n in (144, 256, 1024)]
    for step in range(3):  # the staging buffers are taken in turn: each step's upload must stay its own
        parts = [sources[0], sources[1][100:], sources[2][: 512 >> step]]  # chunked prefill takes slices
        out = upload.to_device(parts, torch.float16)
        torch.cuda.synchronize()
        assert out.dtype == torch.float16 and torch.equal(out.cpu(), torch.cat(parts).half())
