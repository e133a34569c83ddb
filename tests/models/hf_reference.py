"""HF transformers as the reference: greedy `generate` on one prompt at a time (no padding involved)."""

from __future__ import annotations

import torch

# Logit gaps below this are ties within float32 noise across devices: HF's own logits for the same prompt differ by
# ~1e-4 between its CPU and CUDA runs (Qwen3-VL test checkpoint), so a GPU engine may break such a tie the other way.
NEAR_TIE = 1e-3


class Greedy(list):
    """HF's greedy tokens (a list, equal to any list of the same ids), and at each step the runner-up token and how
    far its logit lies below the chosen one's."""

    def __init__(self, tokens: list[int], runner_up: list[int], gap: list[float]) -> None:
        super().__init__(tokens)
        self.runner_up, self.gap = runner_up, gap


def matches_greedy(ours: list[int], ref: Greedy, exact: bool) -> bool:
    """exact: ours == ref token for token (an engine whose arithmetic is HF's: the CPU). Otherwise ours equals ref up
    to its first difference, and there HF's choice was a tie within float32 noise (gap < NEAR_TIE) that ours broke
    for the runner-up; the tokens after it answer a different prefix, so they are not compared."""
    if exact or list(ours) == list(ref):
        return list(ours) == list(ref)
    if len(ours) != len(ref):
        return False
    i = next(i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b)
    return ref.gap[i] < NEAR_TIE and ours[i] == ref.runner_up[i]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = True, **inputs) -> Greedy:
    """With ignore_eos, EOS stays a possible choice but does not stop generation, as our `ignore_eos` does
    (no `min_new_tokens`, which would remove EOS from the choices instead)."""
    gen = model.generation_config
    saved = gen.eos_token_id
    if ignore_eos:
        gen.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                generation_config=gen,
                output_scores=True,
                return_dict_in_generate=True,
                **inputs,
            )
    finally:
        gen.eos_token_id = saved
    top2 = torch.stack(out.scores)[:, 0].float().topk(2)  # each [new tokens, 2]: the scores greedy chose from
    gap = (top2.values[:, 0] - top2.values[:, 1]).tolist()
    return Greedy(out.sequences[0, len(prompt_ids) :].tolist(), top2.indices[:, 1].tolist(), gap)
