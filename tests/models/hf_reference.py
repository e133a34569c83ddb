"""HF transformers as the reference: greedy `generate` on one prompt at a time (no padding involved)."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = True, **inputs) -> list[int]:
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
                **inputs,
            )
    finally:
        gen.eos_token_id = saved
    return out[0, len(prompt_ids) :].tolist()
