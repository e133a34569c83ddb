"""Image embeddings from the shared-memory cache to the device.

The router reads each image's embeddings as a view of its shared-memory segment. A prompt step's parts are gathered
into one pinned buffer (the one CPU copy) and go over in one asynchronous copy on a side stream, so the host returns
while it proceeds beside the step in flight; the compute stream waits for it before the splice. From pageable
memory the driver would copy synchronously, through its own pinned bounce buffers, on the launching thread.

Admitted requests' images are not copied into pinned memory ahead of their step: that shortens a prompt step's
launch but gains nothing end to end, and pins hundreds of MB per burst of large images (docs/performance-history.md).
"""

from __future__ import annotations

import torch

from language.pinned_staging import PinnedStaging


class EmbedUpload:
    def __init__(self, device: torch.device):
        self.device = device
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._staging = PinnedStaging(device, torch.uint8)  # the step's parts, as raw bytes

    def to_device(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """parts (host, each [m_i, width]) -> [sum of m_i, width] on the device, in `dtype` (the visual process may
        run in another)."""
        if self._copy_stream is None:
            return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(dtype)
        rows, width, src_dtype = sum(p.shape[0] for p in parts), parts[0].shape[1], parts[0].dtype
        # [rows, width] over the pinned bytes: reused two steps later, by when this step has been read back
        host = self._staging.host(rows * width * src_dtype.itemsize).view(src_dtype).view(rows, width)
        torch.cat(parts, out=host)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            # Allocated from the copy stream's pool, so it never reuses memory the step in flight still reads;
            # record_stream keeps it from being reused before the compute stream is done with it.
            out = torch.empty((rows, width), dtype=src_dtype, device=self.device)
            out.copy_(host, non_blocking=True)
        out.record_stream(compute)
        compute.wait_stream(self._copy_stream)
        return out.to(dtype)
