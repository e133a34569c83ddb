"""FP8 fidelity on the GPU (issue 33, item 5): the engine with FP8 linears against the same engine in bf16, on one
checkpoint, over image prompts of 32 greedy tokens each:

- the rule at the first divergence of the greedy tokens: each side's token is in the other's top 5
  (mmserve/testing/fidelity.py);
- the mean top-1 agreement of teacher-forced logits: along bf16's greedy tokens, how often FP8's most likely next
  token is bf16's.

The bf16 engine is the reference (it equals HF transformers' greedy tokens on every family's tests). Random weights
give nearly flat logits, closer than FP8's noise: --embed_gain scales the token embeddings of both engines after
load (the embedding stays bf16 in both), so that greedy choices have margins; --embed_gain 1 measures the
checkpoint as it is. The image embeddings come from the bf16 tower for both engines, or with --vit_fp8 from the
FP8 tower for the FP8 engine's prompts.

    python benchmarks/quant_fidelity.py --model_dir /tmp/q2vl7b                         # --quant_type fp8w8a8
    python benchmarks/quant_fidelity.py --model_dir /tmp/q3vl8b_fp8 --reference /tmp/q3vl8b  # a published-layout FP8
                                                                                        # checkpoint vs its bf16
    python benchmarks/quant_fidelity.py --model_dir /tmp/q2vl7b --quant_type none --llm_kv_type int8kv  # 8-bit KV

Prints one line per prompt and a JSON summary line (also appended to $OUT/quant_fidelity.jsonl when $OUT is set)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from language.request import MultimodalItem
from language.sampling_params import SamplingParams
from mmserve.llm import LLM
from mmserve.prep.multimodal.prompt import prompt_processor_class
from mmserve.testing.fidelity import check_top_k_rule, engine_top_k, first_divergence
from mmserve.testing.images import picture
from visual.models.base import vision_model_class

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # the Qwen-VL families' chat turn
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
QUESTIONS = ["Describe this picture.", "What colours dominate?", "Is there a person in it?",
             "Write a caption for this image.", "What could this be a photo of?", "Count the objects you see.",
             "Where might this have been taken?", "Describe the texture."]  # fmt: skip
SIZES = [(336, 336), (896, 896), (640, 480), (480, 640), (1024, 576), (224, 224), (800, 600), (512, 512)]


def build_prompts(model_dir: str, num: int, vit_fp8: bool, device: str) -> tuple[list[list[int]], list, list]:
    """(prompt ids, bf16-tower items, items for the FP8 engine) per prompt: one image each, of several sizes."""
    from transformers import AutoTokenizer

    from visual.models.fp8_linear import quantize_tower

    arch = json.load(open(os.path.join(model_dir, "config.json")))["architectures"][0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompter = prompt_processor_class(arch).from_pretrained(model_dir, tokenizer)
    vision = vision_model_class(arch).from_pretrained(model_dir, torch.device(device), _dtype(device))
    images = [picture(*SIZES[i % len(SIZES)], seed=i) for i in range(num)]
    encoded = [prompter.encode(CHAT.format(VISION + QUESTIONS[i % len(QUESTIONS)]), [im.size])
               for i, im in enumerate(images)]  # fmt: skip

    def items(model) -> list[list[MultimodalItem]]:
        out = []
        for mm, image in zip(encoded, images, strict=True):
            (embeds,) = model.encode([model.preprocess(image)])
            # on the host, as the server's come (from the shared-memory cache): the engine stages them through pinned
            # memory, which a device tensor cannot be gathered into
            out.append([MultimodalItem(offset=mm.offsets[0], embeds=embeds.cpu(), grid_thw=mm.grid_thw[0])])
        return out

    bf16_items = items(vision)
    fp8_items = bf16_items
    if vit_fp8:
        quantize_tower(vision.tower)
        fp8_items = items(vision)
    return [mm.token_ids for mm in encoded], bf16_items, fp8_items


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32  # CPU: a smoke run on a tiny checkpoint


def engine(model_dir: str, gain: float, device: str, **kwargs) -> LLM:
    dtype = str(_dtype(device)).removeprefix("torch.")
    llm = LLM(model_dir, max_total_token_num=32768, data_type=dtype, device=device, **kwargs)
    llm.engine.model.embed_tokens.weight.data.mul_(gain)
    return llm


def answers(generations: list, engine_name: str) -> list[list[int]]:
    """Each generation's tokens; an engine that answered a prompt with none (a refused or failed request) stops the
    run with its finish reason, rather than scoring an empty answer."""
    for n, g in enumerate(generations):
        if not g.token_ids:
            raise SystemExit(f"the {engine_name} engine gave prompt {n} no tokens (finish reason {g.finish_reason})")
    return [g.token_ids for g in generations]


def score_prompt(fp8: LLM, bf16: LLM, prompt: list[int], mine: list[int], yours: list[int], fp8_items: list,
                 bf16_items: list) -> dict:  # fmt: skip
    """The rule at the first divergence of FP8's greedy tokens (mine) from bf16's (yours), and FP8's teacher-forced
    top-1 agreement along bf16's tokens."""
    broken = check_top_k_rule(
        mine, yours, lambda i: engine_top_k(fp8, prompt + yours[:i], fp8_items),
        lambda i: engine_top_k(bf16, prompt + yours[:i], bf16_items),
    )  # fmt: skip
    top1 = [engine_top_k(fp8, prompt + yours[:i], fp8_items, k=1)[0] == yours[i] for i in range(len(yours))]
    return {"prompt_tokens": len(prompt), "first_divergence": first_divergence(mine, yours),
            "rule_ok": broken is None, "top1_agreement": round(sum(top1) / len(top1), 4), "broken": broken}  # fmt: skip


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model_dir", required=True, help="the checkpoint the FP8 engine serves")
    ap.add_argument("--reference", default=None, help="the bf16 engine's checkpoint (default: --model_dir)")
    ap.add_argument("--quant_type", default="fp8w8a8", help="the FP8 engine's --quant_type (none: bf16 linears)")
    ap.add_argument("--llm_kv_type", default="None", help="its KV cache (int8kv, fp8kv; None: the model's dtype)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new_tokens", type=int, default=32)
    ap.add_argument("--embed_gain", type=float, default=4.0)
    ap.add_argument("--vit_fp8", action="store_true", help="the FP8 engine's images through the FP8 tower")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (tiny checkpoints, float32)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    reference_dir = args.reference or args.model_dir
    prompts, bf16_items, fp8_items = build_prompts(reference_dir, args.prompts, args.vit_fp8, args.device)
    greedy = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    bf16 = engine(reference_dir, args.embed_gain, args.device)
    theirs = answers(bf16.generate(prompts, greedy, mm_items=bf16_items), "bf16")
    fp8 = engine(args.model_dir, args.embed_gain, args.device, quant_type=args.quant_type, llm_kv_type=args.llm_kv_type)
    ours = answers(fp8.generate(prompts, greedy, mm_items=fp8_items), "quantized")
    results = [
        score_prompt(fp8, bf16, prompt, mine, yours, fp8_items[n], bf16_items[n])
        for n, (prompt, mine, yours) in enumerate(zip(prompts, ours, theirs, strict=True))
    ]
    for n, r in enumerate(results):
        print(
            f"prompt {n}: {r['prompt_tokens']} tokens, first divergence {r['first_divergence']}, rule "
            f"{'ok' if r['rule_ok'] else r['broken']}, teacher-forced top-1 agreement {r['top1_agreement']:.3f}"
        )
    summary = {
        "bench": "quant_fidelity", "model_dir": args.model_dir, "reference": reference_dir,
        "quant_type": args.quant_type, "llm_kv_type": args.llm_kv_type, "vit_fp8": args.vit_fp8,
        "embed_gain": args.embed_gain,
        "device": device_name(args.device), "prompts": len(results), "new_tokens": args.new_tokens,
        "rule_ok": sum(r["rule_ok"] for r in results),
        "mean_top1_agreement": round(sum(r["top1_agreement"] for r in results) / len(results), 4),
        "exact_sequences": sum(r["first_divergence"] is None for r in results),
        "wall_s": round(time.perf_counter() - t0, 1), "per_prompt": results,
    }  # fmt: skip
    line = json.dumps(summary)
    print(line)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "quant_fidelity.jsonl"), "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
