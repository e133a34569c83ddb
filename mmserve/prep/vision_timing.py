"""Where the visual process's time goes, per image and per video, as Prometheus histograms of the HTTP process (each
EncodeDone carries its item's timings: observing them costs the results task a few microseconds per item):

- `mmserve_vision_preprocess_seconds{kind}`: a preprocessing worker's time on the item: decoding the file and
  running the family's processor (for a video: PyAV decoding, frame sampling, resizing, patching)
- `mmserve_vision_tower_seconds{kind}`: the item's share of its tower batch's time (by the positions the tower
  runs over): upload, vision tower, projector and the copy back to host memory; the sum is the tower's busy time
"""

from __future__ import annotations

from prometheus_client import Histogram

from visual.messages import EncodeDone

# from a small image's milliseconds to a long video's decode (tens of seconds)
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class VisionTiming:
    def __init__(self) -> None:
        # registry=None: the server's registry collects them through VisualLink's collector
        self.preprocess = Histogram(
            "mmserve_vision_preprocess_seconds",
            "A preprocessing worker's time on one image or video: decoding, frame sampling, the processor",
            ["kind"],
            buckets=_BUCKETS,
            registry=None,
        )
        self.tower = Histogram(
            "mmserve_vision_tower_seconds",
            "One image's or video's share of its vision tower batch's time (by the positions the tower runs over)",
            ["kind"],
            buckets=_BUCKETS,
            registry=None,
        )

    def observe(self, done: EncodeDone) -> None:
        kind = "video" if done.video else "image"
        self.preprocess.labels(kind=kind).observe(done.preprocess_s)
        self.tower.labels(kind=kind).observe(done.tower_s)

    def collect(self):
        yield from self.preprocess.collect()
        yield from self.tower.collect()
