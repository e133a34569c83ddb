"""The engine's command-line options, one field each: name, type, default, help and --help group in one place.
No torch here: the server's command line reads them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from language.quant.scheme import QUANT_TYPES

# LightLLM's --data_type spellings -> torch dtype names; "auto" keeps the checkpoint's own dtype.
DTYPE_NAMES = {
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "auto": "auto",
}
# --llm_kv_type spellings (LightLLM's, and vLLM's --kv_cache_dtype values) -> how K and V are stored: "None" in the
# model's dtype, "int8kv" as int8 with a scale per token and KV head, "fp8kv" as float8 e4m3 with a scale per KV head.
KV_TYPE_NAMES = {
    "None": "None",
    "auto": "None",
    "int8kv": "int8kv",
    "int8": "int8kv",
    "fp8kv": "fp8kv",
    "fp8kv_sph": "fp8kv",  # LightLLM v1.2.0: fp8, static scale per head
    "fp8": "fp8kv",
    "fp8_e4m3": "fp8kv",
}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
# Their --help groups (mmserve/launch/cli.py orders them)
_MODEL, _KV, _PARALLEL = "model", "KV cache and scheduling", "parallelism"


def option(default, group: str, help: str, **cli):
    """A field that is also a command-line flag: mmserve/launch/cli.py makes `--<field name>` of it (or `cli["flag"]`),
    in the --help group `group`, with this default, help and the field's type. `cli` may also name `aliases`
    (vLLM's spelling of the flag), `choices` and `nargs`."""
    return field(default=default, metadata={"group": group, "help": help, **cli})


@dataclass(frozen=True)
class EngineOptions:
    """The engine's command-line options; each name is its flag's (LightLLM's), from the command line to the
    engine."""

    # model
    data_type: str = option(
        "auto",
        _MODEL,
        "weights' and activations' dtype (auto: the checkpoint's)",
        choices=sorted(DTYPE_NAMES),
        aliases=("--dtype",),
    )
    device: str = option("auto", _MODEL, "cuda, cuda:<index>, cpu or auto")
    eos_id: tuple[int, ...] | None = option(None, _MODEL, "end-of-sequence ids; omitted: the model's", nargs="+")
    trust_remote_code: bool = option(
        False,
        _MODEL,
        "let transformers run the checkpoint's own code (Qwen-VL-Chat's tokenizer)",
        aliases=("--trust-remote-code",),
    )
    load_format: str = option(
        "auto",
        _MODEL,
        "dummy: random weights built on the device from config.json alone (benchmarks; no weight files read)",
        choices=["auto", "dummy"],
        aliases=("--load-format",),
    )
    # FP8 e4m3 weights (per output channel, quantized at load) and activations (per token, dynamically) for the
    # decoder's linear layers; a checkpoint published in FP8 (block-wise or FP8-dynamic) runs as published whatever
    # this says (language/quant/scheme.py).
    quant_type: str = option(
        "none",
        _MODEL,
        "quantize the language model's linear layers: fp8w8a8 (fp8: vLLM's name) = FP8 e4m3 weights per output "
        "channel and activations per token; the LM head, embedding and norms stay in --data_type. An FP8 "
        "checkpoint runs in its own FP8 format (its head as published)",
        choices=sorted(QUANT_TYPES),
        aliases=("--quantization",),
    )
    # Off by default: on an H100 the FP8 head took 0.14 ms off a 7B batch-1 step and cost fidelity against bf16
    # (docs/quantization.md).
    quant_lm_head: bool = option(
        False,
        _MODEL,
        "with --quant_type fp8w8a8: the LM head in FP8 too (e4m3 per vocabulary row), faster batch-1 decode at a "
        "measured cost in fidelity",
    )
    # On by default: the norms and gated activations write the per-token FP8 linears' inputs quantized, so no
    # quantizer launch re-reads them (language/quant/linear.py); off, each linear quantizes its bf16 input itself.
    fp8_fused_quant: bool = option(
        True,
        _MODEL,
        "with per-token FP8 activations (--quant_type fp8w8a8, FP8-dynamic checkpoints): let each FP8 linear "
        "quantize its input itself instead of the norm or activation before it (the same values, one launch more)",
        flag="disable_fp8_fused_quant",
    )
    output_constraint_mode: str = option(
        "xgrammar",
        _MODEL,
        "structured output (JSON schemas, regexes, grammars, choices) through xgrammar token masks; none: refused",
        choices=["xgrammar", "none"],
    )
    # KV cache and scheduling
    max_total_token_num: int | None = option(
        None, _KV, "KV cache token slots; omitted: sized from free memory and --mem_fraction"
    )
    mem_fraction: float = option(0.9, _KV, "share of free device memory for weights + KV")
    llm_kv_type: str = option(
        "None",
        _KV,
        "how K and V are stored: None in the model's dtype; int8kv: int8 with a scale per token and KV head; "
        "fp8kv (fp8kv_sph): float8 e4m3 with a scale per KV head (1.0). 8 bits hold about twice the tokens",
        choices=list(KV_TYPE_NAMES),
        aliases=("--kv_cache_dtype", "--kv-cache-dtype"),
    )
    running_max_req_size: int = option(1000, _KV, "most requests decoding at once", aliases=("--max-num-seqs",))
    max_req_total_len: int | None = option(
        None,
        _KV,
        "most tokens of prompt + output per request; omitted: the model's context length",
        aliases=("--max-model-len",),
    )
    # Longer prompts are split across steps, so running requests keep decoding while they prefill, and activation
    # memory stays bounded.
    chunked_prefill_size: int = option(
        4096,
        _KV,
        "prompt tokens prefilled per step; longer prompts are split across steps beside decoding requests",
    )
    # Off: whole prompts (a long one still runs alone in its step).
    chunked_prefill: bool = option(True, _KV, "prefill whole prompts, one step each", flag="disable_chunked_prefill")
    # A radix tree of the KV of earlier prompts and answers, reused by requests that share a prefix.
    prefix_cache: bool = option(
        True,
        _KV,
        "turn off the prefix cache (reuse of the KV of earlier prompts, images and answers)",
        flag="disable_dynamic_prompt_cache",
    )
    cuda_graph: bool = option(
        True, _KV, "run every step eagerly", flag="disable_cudagraph", aliases=("--enforce-eager",)
    )
    # Programmatic dependent launch (sm_90+ CUDA): each Triton kernel of a step may start while the one before it
    # drains, and the weight-streaming GEMVs request their first weights then (language/kernels/launch_utils.py).
    # Never on CPU, under the Triton interpreter or before Hopper, whatever this says.
    pdl: bool = option(
        True,
        _KV,
        "launch the Triton kernels one after another, without programmatic dependent launch (on by default on "
        "Hopper and later GPUs)",
        flag="disable_pdl",
    )
    graph_max_batch_size: int = option(256, _KV, "largest decode batch run as a CUDA graph")
    piecewise_cuda_graph_max_tokens: int = option(
        1024,
        _KV,
        "prompt and mixed steps of up to this many tokens replay CUDA graphs of "
        "their dense parts, attention eager (SGLang's piecewise graphs); 0: eager",
    )
    # parallelism
    tp: int = option(
        1, _PARALLEL, "tensor parallel degree: GPUs the model is split over", aliases=("--tensor-parallel-size",)
    )

    def __post_init__(self) -> None:
        if self.data_type not in DTYPE_NAMES:
            raise ValueError(f"--data_type must be one of {sorted(DTYPE_NAMES)}")
        object.__setattr__(self, "data_type", DTYPE_NAMES[self.data_type])  # one spelling from here on
        if self.llm_kv_type not in KV_TYPE_NAMES:
            raise ValueError(f"--llm_kv_type must be one of {list(KV_TYPE_NAMES)}")
        object.__setattr__(self, "llm_kv_type", KV_TYPE_NAMES[self.llm_kv_type])
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"--device {self.device}: must be auto, cpu, cuda or cuda:<index>")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError("--load_format must be auto or dummy")
        if self.quant_type not in QUANT_TYPES:
            raise ValueError(f"--quant_type must be one of {sorted(QUANT_TYPES)}")
        object.__setattr__(self, "quant_type", QUANT_TYPES[self.quant_type])  # fp8 -> fp8w8a8
        if self.output_constraint_mode not in ("xgrammar", "none"):
            raise ValueError("--output_constraint_mode must be xgrammar or none")
        if self.max_total_token_num is not None and self.max_total_token_num < 1:
            raise ValueError("--max_total_token_num must be >= 1")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError("--mem_fraction must be in (0, 1]")
        if self.running_max_req_size < 1:
            raise ValueError("--running_max_req_size must be >= 1")
        if self.max_req_total_len is not None and self.max_req_total_len < 2:
            raise ValueError("--max_req_total_len must be >= 2")
        if self.chunked_prefill_size < 1:
            raise ValueError("--chunked_prefill_size must be >= 1")
        if self.graph_max_batch_size < 1:
            raise ValueError("--graph_max_batch_size must be >= 1")
        if self.piecewise_cuda_graph_max_tokens < 0:
            raise ValueError("--piecewise_cuda_graph_max_tokens must be >= 0")
        if self.tp < 1:
            raise ValueError("--tp must be >= 1")
