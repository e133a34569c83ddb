"""Per-phase timing of the visual process, logged every few seconds at INFO as one `key=value` line so that a
benchmark can read the phases of a run back from the server log (`parse_stats_line`).

    vision stats: images=190 batches=12 images_per_batch=15.8 images_per_s=38.0 decode_ms=17.8 preprocess_ms=14.7
    latency_ms=210.4 tower_ms=120.3 write_ms=8.1 busy=0.61 held=0.12 failed=0

Per image (means over the interval): `decode_ms` and `preprocess_ms` are a pool worker's time to decode the file and
to run the processor; `latency_ms` runs from the job's arrival in the visual process to its embeddings being in
shared memory. Per batch: `tower_ms` is upload + vision tower + projector + the copy back to host memory, `write_ms`
the copies into the shared-memory segments. `busy` is the fraction of the interval spent in those two, `held` the
fraction spent holding a batch while the LM's prompt backlog was full.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

STATS_PREFIX = "vision stats:"
_PAIR = re.compile(r"(\w+)=([-+0-9.eE]+)")


@dataclass
class VisionStats:
    """Running totals; a log line reports the difference between two snapshots (`copy()` takes one)."""

    images: int = 0
    batches: int = 0
    failed: int = 0
    decode_s: float = 0.0
    preprocess_s: float = 0.0
    latency_s: float = 0.0
    tower_s: float = 0.0
    write_s: float = 0.0
    held_s: float = 0.0  # batches held while the LM's prompt backlog was full (VisualEncoder._hold_for_the_lm)

    def copy(self) -> VisionStats:
        return dataclasses.replace(self)

    def add_batch(self, tower_s: float, write_s: float, decode_s: float, preprocess_s: float, latency_s: float,
                  images: int) -> None:  # fmt: skip
        self.batches += 1
        self.images += images
        self.tower_s += tower_s
        self.write_s += write_s
        self.decode_s += decode_s
        self.preprocess_s += preprocess_s
        self.latency_s += latency_s

    def summary(self, since: VisionStats, elapsed_s: float) -> str:
        images = self.images - since.images
        batches = self.batches - since.batches
        per_image, per_batch = max(images, 1), max(batches, 1)
        tower, write = self.tower_s - since.tower_s, self.write_s - since.write_s
        fields = {
            "images": images,
            "batches": batches,
            "images_per_batch": f"{images / per_batch:.1f}",
            "images_per_s": f"{images / max(elapsed_s, 1e-9):.1f}",
            "decode_ms": f"{(self.decode_s - since.decode_s) / per_image * 1e3:.1f}",
            "preprocess_ms": f"{(self.preprocess_s - since.preprocess_s) / per_image * 1e3:.1f}",
            "latency_ms": f"{(self.latency_s - since.latency_s) / per_image * 1e3:.1f}",
            "tower_ms": f"{tower / per_batch * 1e3:.1f}",
            "write_ms": f"{write / per_batch * 1e3:.1f}",
            "busy": f"{(tower + write) / max(elapsed_s, 1e-9):.2f}",
            "held": f"{(self.held_s - since.held_s) / max(elapsed_s, 1e-9):.2f}",
            "failed": self.failed - since.failed,
        }
        return STATS_PREFIX + " " + " ".join(f"{k}={v}" for k, v in fields.items())


def parse_stats_line(line: str) -> dict[str, float] | None:
    """The fields of a `vision stats:` log line (anything before the prefix, e.g. the logger's, is skipped), or
    None for another line."""
    _, found, rest = line.partition(STATS_PREFIX)
    if not found:
        return None
    return {k: float(v) for k, v in _PAIR.findall(rest)}
