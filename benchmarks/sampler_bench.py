"""Time of the sampler alone (`language.sampler.sample`) on random logits, per sampling setting and batch size.

    python benchmarks/sampler_bench.py                       # vocabulary 152,064 (Qwen2-VL), batches 1,16,64,256
    python benchmarks/sampler_bench.py --vocab 32064 --batches 64

Each setting is every row of the batch: greedy through the general path (a logit bias keeps it off the argmax fast
path), temperature alone, OpenAI-style top-p (and with min-p), a top-k too wide for the narrow path, HF-style top-k
50, Qwen's top-k 20 + top-p 0.8, and the same with Qwen's penalties (on tables that already hold 1000 prompt ids a
row)."""

from __future__ import annotations

import argparse

import torch

from language.penalties import PenaltyTables
from language.request import Request
from language.sampler import SamplingBatch, sample
from language.sampling_params import SamplingParams

SETTINGS = {
    "greedy (general path)": dict(logit_bias=((0, 0.5),)),
    "temperature 0.7": dict(do_sample=True, temperature=0.7),
    "top-p 0.9": dict(do_sample=True, temperature=0.7, top_p=0.9),
    "top-p 0.5, min-p 0.05": dict(do_sample=True, temperature=1.0, top_p=0.5, min_p=0.05),
    "top-k 2000, top-p 0.9": dict(do_sample=True, temperature=0.7, top_k=2000, top_p=0.9),
    "top-k 50": dict(do_sample=True, top_k=50),
    "top-k 20, top-p 0.8": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8),
    "the same + penalties": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, presence_penalty=1.5,
                                 repetition_penalty=1.05),
}  # fmt: skip


def time_sample(batch: int, vocab: int, params: SamplingParams, iters: int) -> float:
    """Median µs of build + sample for one step of `batch` rows (each with a 1000-id prompt)."""
    device = torch.device("cuda")
    tables = PenaltyTables(vocab, device)
    reqs = [Request(f"r{i}", [(i * 7 + j) % vocab for j in range(1000)], params) for i in range(batch)]
    logits = torch.randn(batch, vocab, device=device) * 4
    times = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        sb = SamplingBatch.build(reqs, vocab, device, penalty_tables=tables)
        sample(logits, sb)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"| setting (vocab {args.vocab}) | " + " | ".join(f"batch {b}: µs" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name, kw in SETTINGS.items():
        params = SamplingParams(max_new_tokens=16, **kw)
        row = [f"{time_sample(b, args.vocab, params, args.iters):.0f}" for b in batches]
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
