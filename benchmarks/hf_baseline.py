"""HF transformers `generate` on the serving benchmark's work: the same checkpoint, loads, prompts, images and token
counts as `serve_bench.py` (benchmarks/loads.py builds both). The model is loaded once; each load's requests run in
left-padded batches of `batch`, greedy, exactly `new_tokens` new tokens (EOS off).

Concurrent loads report req/s and output tok/s over the whole load (HF has no streaming, so no TTFT there; TPOT is
the batch's wall time per token). Sequential loads (one_336, ...) run batch 1: TTFT is a `generate` of one new token,
TPOT is (full generate - TTFT) / (new_tokens - 1), medians over the repeats. Multi-turn chat loads (chat896_5turn)
are not run here (each turn needs the previous turn's answer, and per-turn TTFT is a serving figure), nor are the
mixed loads (text_mixed_x256, img_mixed_x64, poisson12_x256: lengths per request, arrivals over time): their line
says `skipped`."""

from __future__ import annotations

import inspect
import io
import statistics
import time
from collections.abc import Iterator

import torch
from PIL import Image

from benchmarks.loads import Load, RequestSpec, requests_for
from mmserve.prep.tokenizers import load_tokenizer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# per-token model inputs, left-padded like input_ids when requests are batched
SEQUENCE_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
# families whose inputs come from the checkpoint's own AutoProcessor -> their HF model class
PROCESSOR_FAMILIES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
}


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class HFRunner:
    def __init__(self, family: str, model_dir: str) -> None:
        self.family = family
        self.tokenizer = load_tokenizer(model_dir)
        if family == "llava":
            from transformers import CLIPImageProcessor, LlavaForConditionalGeneration

            cls, dtype = LlavaForConditionalGeneration, torch.float16
            self.processor = CLIPImageProcessor.from_pretrained(model_dir)
        elif family in PROCESSOR_FAMILIES:
            import transformers
            from transformers import AutoProcessor

            # the checkpoint's own processor (Qwen2_5_VLProcessor, Qwen3VLProcessor, InternVLProcessor,
            # Gemma3Processor, which also gives Gemma 3's token_type_ids for its bidirectional image blocks): it expands
            # the image placeholder and returns everything the model takes (input_ids, attention_mask, pixel_values,
            # image_grid_thw, mm_token_type_ids)
            cls, dtype = getattr(transformers, PROCESSOR_FAMILIES[family]), torch.bfloat16
            self.processor = AutoProcessor.from_pretrained(model_dir)
        else:
            from transformers import Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

            cls, dtype = Qwen2VLForConditionalGeneration, torch.bfloat16
            self.processor = Qwen2VLImageProcessor.from_pretrained(model_dir)
        self.model = cls.from_pretrained(model_dir, dtype=dtype if DEVICE == "cuda" else torch.float32)
        self.model = self.model.to(DEVICE).eval()
        # transformers >= 5 takes the image-token mask as `mm_token_type_ids`; older ones find image tokens by id
        self.takes_mm_types = "mm_token_type_ids" in inspect.signature(self.model.forward).parameters
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = self.pad

    def item(self, spec: RequestSpec) -> dict:
        """One request's model inputs: ids with the image placeholder expanded, and its pixel tensors; for the Qwen
        families also `mm_token_type_ids` (1 on image tokens), without which HF's generate silently gives every
        token plain 1-D positions instead of M-RoPE's."""
        if self.family in PROCESSOR_FAMILIES:
            images = [Image.open(io.BytesIO(png)).convert("RGB") for png in spec.images] or None
            out = dict(self.processor(text=[spec.prompt], images=images, return_tensors="pt"))
            if not self.takes_mm_types:
                out.pop("mm_token_type_ids", None)
            return out
        if spec.image_png is None:
            return {"input_ids": torch.tensor([self.tokenizer(spec.prompt).input_ids])}
        image = Image.open(io.BytesIO(spec.image_png)).convert("RGB")
        if self.family == "llava":
            cfg = self.model.config
            num = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2
            head, tail = spec.prompt.split("<image>")
            tail_ids = self.tokenizer(tail, add_special_tokens=False).input_ids
            ids = self.tokenizer(head).input_ids + [cfg.image_token_id] * num + tail_ids
            return {
                "input_ids": torch.tensor([ids]),
                "pixel_values": self.processor([image], return_tensors="pt")["pixel_values"],
            }
        out = self.processor([image], return_tensors="pt")
        n = int(out.image_grid_thw.prod()) // self.processor.merge_size**2
        text = spec.prompt.replace("<|image_pad|>", "<|image_pad|>" * n)
        ids = torch.tensor([self.tokenizer(text).input_ids])
        item = {"input_ids": ids, "pixel_values": out.pixel_values, "image_grid_thw": out.image_grid_thw}
        if self.takes_mm_types:  # what Qwen2VLProcessor returns: 1 on the image pads, 0 elsewhere
            item["mm_token_type_ids"] = (ids == self.model.config.image_token_id).long()
        return item

    def collate(self, items: list[dict]) -> dict:
        """Left-pad the per-token tensors (input_ids, attention_mask, mm_token_type_ids) to one batch; image
        tensors (pixel_values, image_grid_thw) concatenate. Every key of the items reaches the batch."""
        width = max(it["input_ids"].shape[1] for it in items)
        batch = {}
        for key in items[0]:
            if key in SEQUENCE_KEYS:
                fill = self.pad if key == "input_ids" else 0
                col = torch.full((len(items), width), fill, dtype=items[0][key].dtype)
                for i, it in enumerate(items):
                    n = it[key].shape[1]
                    col[i, width - n :] = it[key][0]
                batch[key] = col
            else:
                batch[key] = torch.cat([it[key] for it in items])
        if "attention_mask" not in batch:
            batch["attention_mask"] = torch.zeros((len(items), width), dtype=torch.long)
            for i, it in enumerate(items):
                batch["attention_mask"][i, width - it["input_ids"].shape[1] :] = 1
        return {k: v.to(DEVICE) for k, v in batch.items()}

    @torch.inference_mode()
    def greedy(self, items: list[dict], new_tokens: int) -> list[list[int]]:
        """The new token ids of one batched greedy generate (for checking batched against alone)."""
        batch = self.collate(items)
        out = self.model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return out[:, batch["input_ids"].shape[1] :].tolist()

    @torch.inference_mode()
    def generate(self, items: list[dict], new_tokens: int) -> float:
        """Seconds for one batched greedy generate of exactly `new_tokens` tokens (inputs built beforehand)."""
        batch = self.collate(items)
        _sync()
        t0 = time.perf_counter()
        self.model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        _sync()
        return time.perf_counter() - t0

    def run(self, load: Load, new_tokens: int, batch: int, n_words: int = 64) -> dict:
        if load.is_chat:
            raise ValueError(f"{load.name}: multi-turn chat loads are not run by the HF baseline")
        specs, _ = requests_for(load, self.family, n_words)
        items = [self.item(s) for s in specs]
        self.generate(items[:2], 4)  # warm-up at this load's shapes
        prompt_tokens = statistics.median(it["input_ids"].shape[1] for it in items)
        if load.sequential:
            ttft = [self.generate([it], 1) for it in items]
            lat = [self.generate([it], new_tokens) for it in items]
            tpot = [(lt - ft) / max(1, new_tokens - 1) for lt, ft in zip(lat, ttft, strict=True)]
            wall = sum(lat)
            return {
                "num_requests": len(items),
                "req_per_s": len(items) / wall,
                "out_tok_per_s": len(items) * new_tokens / wall,
                "ttft_p50_s": statistics.median(ttft),
                "tpot_p50_ms": statistics.median(tpot) * 1e3,
                "tpot_method": "generate_1_vs_n",
                "wall_s": wall,
                "prompt_tokens_p50": prompt_tokens,
                "sequential": True,
            }
        step_walls = [self.generate(items[i : i + batch], new_tokens) for i in range(0, len(items), batch)]
        wall = sum(step_walls)
        return {
            "num_requests": len(items),
            "req_per_s": len(items) / wall,
            "out_tok_per_s": len(items) * new_tokens / wall,
            "ttft_p50_s": None,
            "tpot_p50_ms": statistics.median(step_walls) / new_tokens * 1e3,
            "tpot_method": "batch_wall_per_token",
            "wall_s": wall,
            "prompt_tokens_p50": prompt_tokens,
            "hf_batch": batch,
        }


def skip_reason(load: Load) -> str | None:
    if load.is_chat:
        return "multi-turn chat: not run by the HF baseline (serving servers only)"
    if load.mixed:
        return "mixed lengths or arrivals over time: not run by the HF baseline (serving servers only)"
    return None


def run_hf_loads(
    family: str, model_dir: str, loads: list[Load], new_tokens: int, batch: int, n_words: int = 64
) -> Iterator[dict]:
    """One result dict per load (the model is loaded once); a load that fails (e.g. out of memory) says so, and a
    multi-turn chat or mixed load is skipped."""
    if all(skip_reason(load) for load in loads):  # nothing to load the model for
        yield from ({"load": load.name, "skipped": skip_reason(load)} for load in loads)
        return
    runner = HFRunner(family, model_dir)
    for load in loads:
        if skip_reason(load):
            yield {"load": load.name, "skipped": skip_reason(load)}
            continue
        try:
            yield {"load": load.name, **runner.run(load, new_tokens, batch, n_words)}
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            yield {"load": load.name, "error": f"out of memory: {str(e)[:200]}"}
