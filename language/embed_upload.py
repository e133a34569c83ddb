"""Image embeddings from the shared-memory cache to the device, with no CPU copy on the launching thread.

The router reads each image's embeddings as a view of its shared-memory segment. Copying those views at launch
time, into one buffer to upload, put a copy of up to ~30 MB (and the page faults of segments touched for the first
time) on the launching thread between two prompt steps, while the device waited for the step's first kernel.

Instead, as a request is added, a helper thread copies its images into pinned host memory (`prefetch`); torch's copy
releases the GIL, so the router goes on meanwhile. The step that prefills the request then uploads each image part
straight from its pinned copy, one asynchronous copy each on a side stream (`to_device`). A part whose copy is not
done yet (a request admitted and run at once) still goes through one pinned staging buffer, as before. An item's
`embeds` is replaced only once its copy is complete, so the launching thread sees one or the other, never a part.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from language.pinned_staging import PinnedStaging
from language.request import MultimodalItem


class EmbedUpload:
    def __init__(self, device: torch.device):
        self.device = device
        on_gpu = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if on_gpu else None
        self._staging = PinnedStaging(device, torch.uint8)  # parts not prefetched yet, as raw bytes
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="embed-prefetch") if on_gpu else None

    def prefetch(self, items: Sequence[MultimodalItem]) -> None:
        """Start copying these items' embeddings into pinned memory (on GPU; nothing on CPU)."""
        if self._prefetcher is None:
            return
        for item in items:
            if item.embeds is not None and item.embeds.device.type == "cpu" and not item.embeds.is_pinned():
                self._prefetcher.submit(_pin, item, item.embeds)

    def to_device(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """parts (host, each [m_i, width]) -> [sum of m_i, width] on the device, in `dtype` (the visual process may
        run in another). On GPU the copies run on a side stream: the host returns at once, and the compute stream
        waits for them before the splice."""
        if self._copy_stream is None:
            return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(dtype)
        rows = [p.shape[0] for p in parts]
        width, src_dtype = parts[0].shape[1], parts[0].dtype
        if not all(p.is_pinned() for p in parts):
            # One gather into the staging buffer: reused two steps later, by when this step has been read back.
            host = self._staging.host(sum(rows) * width * src_dtype.itemsize).view(src_dtype).view(-1, width)
            parts, rows = [torch.cat(parts, out=host)], [host.shape[0]]
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            # Allocated from the copy stream's pool, so it never reuses memory the step in flight still reads;
            # record_stream keeps it from being reused before the compute stream is done with it. Each pinned
            # source stays allocated until its copy has run (torch's pinned allocator records the copy's stream).
            out = torch.empty((sum(rows), width), dtype=src_dtype, device=self.device)
            for dst, src in zip(torch.split(out, rows), parts, strict=True):
                dst.copy_(src, non_blocking=True)
        out.record_stream(compute)
        compute.wait_stream(self._copy_stream)
        return out.to(dtype)


def _pin(item: MultimodalItem, src: torch.Tensor) -> None:
    """item.embeds := a pinned copy of src, unless the item moved on meanwhile."""
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    pinned.copy_(src)
    if item.embeds is src:
        item.embeds = pinned  # one attribute store: the launching thread sees the view or the whole copy
