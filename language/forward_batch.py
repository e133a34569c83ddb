"""Everything one forward pass needs, as tensors on the model's device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from language.kv_cache import KVCache


@dataclass
class ForwardBatch:
    is_prefill: bool
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, or [3, num_tokens] for M-RoPE models
    out_slots: torch.Tensor  # [num_tokens] int64: KV slot each new token is written to
    req_idx: torch.Tensor  # [num_seqs] int32: row of each sequence in kv.req_to_token
    seq_lens: torch.Tensor  # [num_seqs] int32: cached tokens of each sequence after this pass
    q_starts: torch.Tensor  # [num_seqs] int32: first row of each sequence in input_ids
    q_lens: torch.Tensor  # [num_seqs] int32: new tokens of each sequence in this pass
    logits_idx: torch.Tensor  # [num_seqs] int64: row of each sequence's last token
    max_q_len: int
    kv: KVCache
    mm_embeds: torch.Tensor | None = None  # [num_mm_tokens, hidden] image embeddings to splice in
    mm_positions: torch.Tensor | None = None  # [num_mm_tokens] int64 rows of input_ids they replace

    @property
    def num_seqs(self) -> int:
        return self.req_idx.shape[0]
