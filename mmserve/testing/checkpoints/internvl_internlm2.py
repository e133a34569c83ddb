"""Random-weight InternVL2.5 checkpoints with an InternLM2 language model, in the remote-code layout as published
(`OpenGVLab/InternVL2_5-8B`): `InternVLChatModel` whose `llm_config` is InternLM2's (`InternLM2ForCausalLM`,
model_type `internlm2`, `bias`, dynamic-NTK `rope_scaling`), tensors `language_model.model.tok_embeddings`,
`layers.N.attention.wqkv` (packed per KV head: its query heads, then its key, then its value), `attention.wo`,
`feed_forward.w1/w3/w2`, `attention_norm`, `ffn_norm`, `norm`, `language_model.output`; the tower and projector as in
InternVL3 (internvl_chat.py). Its tokenizer is a sentencepiece `tokenizer.model` (no dummy prefix, identity
normalisation, InternLM2's `<|im_start|>`-style pieces) that tokenizer_config.json's `auto_map` hands
to remote code, `tokenization_internlm2.InternLM2Tokenizer`.

The published remote code is not ours to ship: the module written here is a stand-in that names transformers' own
sentencepiece-converted LlamaTokenizer (`legacy=False`, no prefix space: what transformers' InternVL conversion uses
for InternLM2's tokenizer) under InternLM2's class name, so that the folder loads through transformers' remote-code
path (`--trust_remote_code`) as the published one does.

The same weights are written in the -hf layout too (`<out_dir>-hf`: a Llama `text_config`, q/k/v separate, the
tokenizer saved natively): HF's InternVLForConditionalGeneration on it is the reference. The packing of `wqkv` below
is the inverse of the published modeling's view of it, written independently of the loader's unpacking.

    python -m mmserve.testing.checkpoints.internvl_internlm2 --out DIR --shape 8b    # InternVL2.5-8B shapes, bf16
"""

from __future__ import annotations

import argparse
import io
import json
import os

import sentencepiece as spm
import torch
from safetensors.torch import save_file

from mmserve.prep.chat_templates import INTERNVL, INTERNVL_SYSTEM_PROMPT
from mmserve.testing.checkpoints import internvl
from mmserve.testing.checkpoints.internvl import INTERNVL_TOKENS, VIDEO_TOKEN, preprocessor_config, projector_specs
from mmserve.testing.checkpoints.internvl_chat import internvl_chat_config, remote_tensors
from mmserve.testing.checkpoints.llama import llama_tensor_specs
from mmserve.testing.checkpoints.tokenizer import _CORPUS
from mmserve.testing.checkpoints.writer import read_checkpoint, write_checkpoint, write_json

# InternLM2's chat pieces, user-defined symbols of its sentencepiece model (92538-92543 in the published one)
INTERNLM2_PIECES = ("<|plugin|>", "<|interpreter|>", "<|action_end|>", "<|action_start|>", "<|im_end|>", "<|im_start|>")
SP_PIECES = 400  # the tiny sentencepiece vocabulary; InternVL's tokens follow it, as they follow InternLM2's 92544
SHAPES = {
    "tiny": dict(text=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                           intermediate_size=128), vocab=SP_PIECES + len(INTERNVL_TOKENS)),
    "8b": dict(text=dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336), vocab=92553),
}  # fmt: skip
STAND_IN = '''"""A stand-in for InternLM2's remote tokenizer code (a test checkpoint): transformers' LlamaTokenizer,
converted from tokenizer.model with legacy=False and no prefix space."""

from transformers import LlamaTokenizer


class InternLM2Tokenizer(LlamaTokenizer):
    vocab_files_names = {"vocab_file": "tokenizer.model"}
'''


def sentencepiece_model() -> bytes:
    """A small BPE trained here, deterministically, with InternLM2's settings (ids: <unk> 0, <s> 1, </s> 2) but no
    byte fallback: random weights pick byte pieces at random, and transformers' byte-fallback decoder turns a whole
    run of bytes that is not UTF-8 into one U+FFFD per byte, so that text decoded piece by piece (the server's
    streaming) differs from decode(all) on such runs. Every character of the corpus (and of InternVL's system
    message) is a piece: the prompts here use no other."""
    system = f"<|im_start|>system\n{INTERNVL_SYSTEM_PROMPT}<|im_end|>\n"  # the built-in template's
    text = [f"{system}<|im_start|>user\n{doc}<|im_end|>\n<|im_start|>assistant\n" for doc in _CORPUS] * 20
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=out, vocab_size=SP_PIECES, model_type="bpe",
        add_dummy_prefix=False, normalization_rule_name="identity", remove_extra_whitespaces=False,
        user_defined_symbols=list(INTERNLM2_PIECES), byte_fallback=False, character_coverage=1.0, num_threads=1,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    return out.getvalue()


def _added_token(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True}  # fmt: skip


def write_remote_tokenizer(out_dir: str, model: bytes) -> None:
    """tokenizer.model, tokenizer_config.json naming the remote class, and the stand-in module."""
    sp = spm.SentencePieceProcessor(model_proto=model)
    added = {str(sp.piece_to_id(p)): _added_token(p) for p in INTERNLM2_PIECES}
    added |= {str(SP_PIECES + i): _added_token(tok) for i, tok in enumerate(INTERNVL_TOKENS)}
    with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
        f.write(model)
    with open(os.path.join(out_dir, "tokenization_internlm2.py"), "w") as f:
        f.write(STAND_IN)
    write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "auto_map": {"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer", None]},
        "tokenizer_class": "InternLM2Tokenizer", "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", *INTERNVL_TOKENS],
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 16384,
    })  # fmt: skip


def write_hf_tokenizer(out_dir: str, model_dir_with_sp: str) -> None:
    """The same tokenizer saved natively for the -hf layout, with the names InternVLProcessor reads (its
    `<video>`, after the vocabulary the model knows, never occurs here)."""
    from transformers import LlamaTokenizer

    tokenizer = LlamaTokenizer.from_pretrained(
        model_dir_with_sp, legacy=False, add_prefix_space=False,
        extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                              "context_image_token": "<IMG_CONTEXT>", "video_token": VIDEO_TOKEN},
    )  # fmt: skip
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *INTERNVL_TOKENS, VIDEO_TOKEN]}
    )
    tokenizer.chat_template = INTERNVL
    tokenizer.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("auto_map", None)  # native: no remote code
    write_json(path, {**config, "tokenizer_class": "LlamaTokenizer"})


def text_config(shape: str) -> dict:
    """The -hf layout's Llama text_config (transformers' conversion: llm_config's fields less `bias`)."""
    s = SHAPES[shape]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 2, "hidden_act": "silu", "initializer_range": 0.02,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_scaling": {"type": "dynamic", "factor": 2.0},
        "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": s["vocab"], **s["text"],
    }  # fmt: skip


def llm_config(text: dict) -> dict:
    """InternVL2.5-8B's `llm_config` for the same decoder."""
    fields = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "attention_bias")}
    return {**fields, "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "bias": False,
            "attn_implementation": "flash_attention_2",
            "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                         "AutoModel": "modeling_internlm2.InternLM2ForCausalLM",
                         "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"}}  # fmt: skip


def internlm2_tensors(hf: dict[str, torch.Tensor], text: dict) -> dict[str, torch.Tensor]:
    """The -hf decoder's tensors (`language_model.model.*` Llama names) -> InternLM2's, q/k/v packed in `wqkv`."""
    heads, kv, h = text["num_attention_heads"], text["num_key_value_heads"], text["hidden_size"]
    d, group = h // heads, heads // kv
    renames = {"self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
               "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm",
               "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    out = {"language_model.model.tok_embeddings.weight": hf["language_model.model.embed_tokens.weight"],
           "language_model.model.norm.weight": hf["language_model.model.norm.weight"],
           "language_model.output.weight": hf["language_model.lm_head.weight"]}  # fmt: skip
    for i in range(text["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        for ours, theirs in renames.items():
            out[p + theirs + ".weight"] = hf[p + ours + ".weight"]
        # the published modeling reads wqkv's rows as (kv heads, group + 2, head_dim): q heads of the group, k, v
        q = hf[p + "self_attn.q_proj.weight"].view(kv, group, d, h)
        k = hf[p + "self_attn.k_proj.weight"].view(kv, 1, d, h)
        v = hf[p + "self_attn.v_proj.weight"].view(kv, 1, d, h)
        out[p + "attention.wqkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h).contiguous()
    return out


def build_internvl_internlm2(
    out_dir: str, shape: str = "tiny", dtype: torch.dtype = torch.float32, hf_dir: str | None = None, seed: int = 0,
    device: str = "cpu",
) -> str:  # fmt: skip
    """Write the remote-code layout to out_dir and the same weights in the -hf layout to hf_dir (default
    `<out_dir>-hf`); returns out_dir."""
    hf_dir = hf_dir or out_dir.rstrip("/") + "-hf"
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(hf_dir, exist_ok=True)
    write_remote_tokenizer(out_dir, sentencepiece_model())
    write_hf_tokenizer(hf_dir, out_dir)
    vision, text = internvl.SHAPES[shape]["vision"], text_config(shape)
    hf_config = {
        "architectures": ["InternVLForConditionalGeneration"], "downsample_ratio": 0.5,
        "image_seq_length": internvl.image_seq_length(vision), "image_token_id": SP_PIECES + 2,
        "model_type": "internvl", "projector_hidden_act": "gelu", "text_config": text, "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."), "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
        "vision_config": {"model_type": "internvl_vision", "attention_bias": True, "layer_norm_eps": 1e-06,
                          "use_absolute_position_embeddings": True, "use_mean_pooling": True, "use_qk_norm": False,
                          "norm_type": "layer_norm", "hidden_act": "gelu", "layer_scale_init_value": 0.1, **vision},
    }  # fmt: skip
    write_json(os.path.join(hf_dir, "config.json"), hf_config)
    im_end = INTERNLM2_PIECES.index("<|im_end|>") + 3  # the user-defined pieces follow <unk>, <s>, </s>
    write_json(os.path.join(hf_dir, "generation_config.json"), {"bos_token_id": 1, "eos_token_id": im_end})
    write_json(os.path.join(hf_dir, "preprocessor_config.json"), preprocessor_config(vision["image_size"][0]))
    write_json(os.path.join(hf_dir, "processor_config.json"),
               {"image_seq_length": hf_config["image_seq_length"], "processor_class": "InternVLProcessor"})  # fmt: skip
    specs = llama_tensor_specs(text, prefix="language_model.model.", lm_head="language_model.lm_head.weight")
    specs += internvl.vision_tensor_specs(vision, "vision_tower.")
    specs += projector_specs("multi_modal_projector.", vision["hidden_size"], text["hidden_size"])
    write_checkpoint(hf_dir, specs, dtype, num_shards=None, seed=seed, device=device)

    remote = internvl_chat_config(hf_config, shape)
    remote["llm_config"] = {**llm_config(text), "torch_dtype": "bfloat16"}
    write_json(os.path.join(out_dir, "config.json"), remote)
    write_json(os.path.join(out_dir, "generation_config.json"), {"bos_token_id": 1, "eos_token_id": im_end})
    hf = read_checkpoint(hf_dir)
    lm = {k: v for k, v in hf.items() if k.startswith("language_model.")}
    tensors = remote_tensors({k: v for k, v in hf.items() if k not in lm}) | internlm2_tensors(lm, text)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a random-weight InternVL2.5 (InternLM2) remote-code checkpoint")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 for 8b, float32 for tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.shape != "tiny" else "float32"))
    build_internvl_internlm2(args.out, args.shape, dtype, device=args.device)
    print(f"wrote {args.shape} InternVL2.5 (InternLM2, remote-code layout) to {args.out} and its -hf twin")


if __name__ == "__main__":
    main()
