"""Everything one forward pass needs, as tensors on the model's device. A batch is decode rows (one token per
sequence) followed by prefill chunks (many tokens per sequence, possibly behind a cached prefix)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from language.kv_cache import KVCache


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, or [3, num_tokens] for M-RoPE models
    out_slots: torch.Tensor  # [num_tokens] int64: KV slot each new token is written to
    num_decode: int  # the first num_decode tokens (and sequences) are decode rows
    req_idx: torch.Tensor  # [num_seqs] int64: row of each sequence in kv.req_to_token, decode rows first
    decode_seq_lens: torch.Tensor  # [num_decode] int64: cached tokens of each decode row after this pass
    prefill_req_idx: torch.Tensor  # [num_prefill_seqs] int64 (its own array: kernels see aligned pointers)
    prefill_seq_lens: torch.Tensor  # [num_prefill_seqs] int64: cached tokens of each chunk's sequence after it
    q_starts: torch.Tensor  # [num_prefill_seqs] int64: first row of each chunk, counted from row num_decode
    q_lens: torch.Tensor  # [num_prefill_seqs] int64: tokens of each chunk
    max_q_len: int
    kv: KVCache
    max_decode_len: int | None = None  # longest decode sequence, if known on the host (bounds the split-K grid)
    logits_idx: torch.Tensor | None = None  # [num_seqs] int64 row of each sequence's last token; None: every row
    mm_embeds: torch.Tensor | None = None  # [num_mm_tokens, hidden] image embeddings to splice in
    mm_positions: torch.Tensor | None = None  # [num_mm_tokens] int64 rows of input_ids they replace
    # Bidirectional image blocks (a decoder's `bidirectional_images`), on steps with image rows: [num_prefill_tokens]
    # int64, per prefill row the kv position its keys may reach (exclusive): its image's end, or 0 for text
    prefill_key_ends: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.req_idx.shape[0]
