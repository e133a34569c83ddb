"""HF transformers on the video benchmark's work (benchmarks/video_bench.py): the same clips, prompts, sampling and
token counts, through the checkpoint's model class and the family's HF processor, the way a transformers user runs
it: transformers' PyAV reader (`read_video_pyav`) decodes each clip keeping the frames the video processor's own
`sample_frames` picks, the processor resizes and patches them, and `generate` runs greedy in left-padded batches
(`batch`, halved after an out-of-memory error until one fits), EOS off.

Stages, each timed on its own (the GPU synchronized around it): `decode_sample` (the reader: PyAV decoding and frame
sampling, per clip), `processor` (HF's processor: resize, normalize, patches, prompt expansion, per clip), `tower`
(the vision tower and projector on the batch's videos, run alone), `prefill` (from `generate`'s start to its first
logits, the tower's time taken off) and `decode` (from the first logits to the end): one timed `generate` a batch."""

from __future__ import annotations

import io
import statistics
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from benchmarks.hf_baseline import DEVICE, HFRunner, _sync

VIDEO_PROCESSOR_CLASSES = {
    "qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
}


class FirstLogits(LogitsProcessor):
    """Notes when generate's first logits are ready (the prompt's forward done): the end of the prefill."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.at is None:
            _sync()
            self.at = time.perf_counter()
        return scores


class HFVideoRunner:
    def __init__(self, family: str, model_dir: str) -> None:
        if family not in VIDEO_PROCESSOR_CLASSES:
            raise ValueError(f"no HF video baseline for {family}; one of {', '.join(VIDEO_PROCESSOR_CLASSES)}")
        import transformers

        self.runner = HFRunner(family, model_dir)
        processor_name, video_name = VIDEO_PROCESSOR_CLASSES[family]
        video_class = getattr(transformers, video_name)
        try:
            self.video_processor = video_class.from_pretrained(model_dir)
        except OSError:  # no processor files: the class's defaults, as the server then takes them
            self.video_processor = video_class()
        image_processor = getattr(self.runner.processor, "image_processor", self.runner.processor)
        self.processor = getattr(transformers, processor_name)(
            image_processor=image_processor, tokenizer=self.runner.tokenizer, video_processor=self.video_processor
        )
        self.takes_mm_types = self.runner.takes_mm_types

    def read(self, data: bytes, sampling: dict):
        """(frames sampled as the video processor samples them, their metadata), by transformers' PyAV reader."""
        from transformers.video_utils import read_video_pyav

        def indices(metadata, **_):
            return self.video_processor.sample_frames(metadata, **sampling)

        return read_video_pyav(io.BytesIO(data), indices)

    def item(self, prompt: str, frames, metadata, sampling: dict) -> dict:
        kwargs = {"do_sample_frames": False}
        if sampling.get("max_pixels") or sampling.get("min_pixels"):
            size = self.video_processor.size
            kwargs["size"] = {"shortest_edge": sampling.get("min_pixels") or size.shortest_edge,
                              "longest_edge": sampling.get("max_pixels") or size.longest_edge}  # fmt: skip
        out = dict(self.processor(text=[prompt], videos=[frames], video_metadata=[metadata], videos_kwargs=kwargs,
                                  return_tensors="pt"))  # fmt: skip
        if not self.takes_mm_types:
            out.pop("mm_token_type_ids", None)
        return out

    @torch.inference_mode()
    def tower(self, batch: dict) -> float:
        """Seconds of the vision tower and projector on the batch's videos."""
        pixels = batch["pixel_values_videos"].to(DEVICE, self.runner.model.dtype)
        grid = batch["video_grid_thw"].to(DEVICE)
        _sync()
        t0 = time.perf_counter()
        self.runner.model.get_video_features(pixels, grid)
        _sync()
        return time.perf_counter() - t0

    def run(self, prompts: list[str], clips: list[bytes], sampling: dict, new_tokens: int, batch: int) -> dict:
        stages = {"decode_sample": 0.0, "processor": 0.0, "tower": 0.0, "prefill": 0.0, "decode": 0.0}
        items = []
        for prompt, data in zip(prompts, clips, strict=True):
            t0 = time.perf_counter()
            frames, metadata = self.read(data, sampling)
            t1 = time.perf_counter()
            items.append(self.item(prompt, frames, metadata, sampling))
            stages["decode_sample"] += t1 - t0
            stages["processor"] += time.perf_counter() - t1
        self.runner.generate(items[:1], 2)  # warm-up at these shapes
        while True:
            try:
                walls = [self._timed_batch(items[i : i + batch], new_tokens) for i in range(0, len(items), batch)]
                break
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                if batch == 1:
                    raise
                batch //= 2
        for wall in walls:
            for k in ("tower", "prefill", "decode"):
                stages[k] += wall[k]
        generate_s = sum(w["generate"] for w in walls)
        return {
            "num_requests": len(items),
            "req_per_s": len(items) / generate_s,
            "out_tok_per_s": len(items) * new_tokens / generate_s,
            "ttft_p50_s": None,
            "tpot_p50_ms": statistics.median(w["decode"] for w in walls) / max(1, new_tokens - 1) * 1e3,
            "tpot_method": "batch_decode_per_token",
            "wall_s": generate_s,
            "prompt_tokens_p50": statistics.median(it["input_ids"].shape[1] for it in items),
            "hf_batch": batch,
            "stages_s": stages,
            "stages_note": "sums over the clips (decode_sample, processor) and over the batches (tower, prefill, "
            "decode; the tower also runs inside generate, timed alone before it); wall_s is the generate time alone",
        }

    @torch.inference_mode()
    def _timed_batch(self, items: list[dict], new_tokens: int) -> dict:
        batch = self.runner.collate(items)
        tower = self.tower(batch)
        first = FirstLogits()
        _sync()
        t0 = time.perf_counter()
        self.runner.model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                   logits_processor=LogitsProcessorList([first]))  # fmt: skip
        _sync()
        end = time.perf_counter()
        return {"tower": tower, "prefill": max(first.at - t0 - tower, 0.0), "decode": end - first.at,
                "generate": end - t0}  # fmt: skip
