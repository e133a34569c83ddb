"""Which quantization the decoder runs: none, FP8 weights quantized at load (`--quant_type fp8w8a8`, vLLM's
`--quantization fp8`), or the FP8 a checkpoint was published in, read from its config.json:

- `quant_method: fp8` with `weight_block_size: [128, 128]` and dynamic activations (Qwen3-VL-*-FP8, DeepSeek-V3's
  recipe): e4m3 weights with one `weight_scale_inv` per 128x128 block; activations quantized per token and 128
  columns;
- `quant_method: compressed-tensors` with 8-bit float weights per channel and dynamic per-token activations
  (llm-compressor's FP8-dynamic): e4m3 weights with `weight_scale` [N, 1].

A checkpoint's own quantization applies whatever --quant_type says (its weights are e4m3). No torch here."""

from __future__ import annotations

from dataclasses import dataclass

QUANT_TYPES = {"none": "none", "fp8w8a8": "fp8w8a8", "fp8": "fp8w8a8"}  # LightLLM's names, vLLM's alias


@dataclass(frozen=True)
class QuantScheme:
    prequantized: bool  # the checkpoint's weights are e4m3 already
    scale_name: str  # the weights' scale tensors: weight_scale_inv (block-wise) or weight_scale (per channel)
    block: tuple[int, int] | None = None  # (rows, columns) per weight scale of a block-wise checkpoint

    def scale_groups(self, in_features: int) -> int:
        """Scale columns of a weight with `in_features` columns: one per block, or one per row."""
        return 1 if self.block is None else -(-in_features // self.block[1])

    def describe(self) -> str:
        if self.block is not None:
            return f"FP8 e4m3, the checkpoint's {self.block[0]}x{self.block[1]} weight blocks"
        return "FP8 e4m3, " + ("the checkpoint's" if self.prequantized else "quantized at load,") + " per channel"


# --quant_type fp8w8a8 on a bf16/fp16 checkpoint: e4m3 weights per output channel, quantized at load.
PER_CHANNEL_AT_LOAD = QuantScheme(prequantized=False, scale_name="weight_scale")


def quant_scheme(quant_type: str, raw_config: dict) -> QuantScheme | None:
    """The decoder's scheme (None: unquantized). ValueError for a quantized checkpoint this engine cannot run."""
    config = raw_config.get("quantization_config") or (raw_config.get("text_config") or {}).get("quantization_config")
    if config:
        return _checkpoint_scheme(config)
    if QUANT_TYPES[quant_type] == "fp8w8a8":
        return PER_CHANNEL_AT_LOAD
    return None


def _checkpoint_scheme(config: dict) -> QuantScheme:
    method = config.get("quant_method")
    if method == "fp8":
        return _block_fp8_scheme(config)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    raise ValueError(f"quantization_config.quant_method {method!r}: only fp8 and compressed-tensors (FP8) are served")


def _block_fp8_scheme(config: dict) -> QuantScheme:
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError("FP8 checkpoints with static activation scales are not served (activation_scheme: dynamic)")
    if config.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 checkpoint format {config.get('fmt')!r}: only e4m3 is served")
    block = config.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError("FP8 checkpoints without weight_block_size (per-tensor scales) are not served")
    if any(_names_decoder_layer(name) for name in config.get("modules_to_not_convert") or ()):
        raise ValueError("FP8 checkpoints that leave some decoder layers unquantized are not served")
    return QuantScheme(prequantized=True, scale_name="weight_scale_inv", block=(int(block[0]), int(block[1])))


def _compressed_tensors_scheme(config: dict) -> QuantScheme:
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError("compressed-tensors checkpoints with other than one quantization group are not served")
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
    fp8_channel = (weights.get("type"), weights.get("num_bits"), weights.get("strategy")) == ("float", 8, "channel")
    dynamic_token = inputs.get("dynamic") is True and inputs.get("strategy") == "token"
    if not (fp8_channel and dynamic_token):
        raise ValueError(
            "compressed-tensors: only FP8-dynamic is served (8-bit float weights per channel, dynamic per-token "
            "activations)"
        )
    return QuantScheme(prequantized=True, scale_name="weight_scale")


def _names_decoder_layer(module: str) -> bool:
    parts = module.split(".")
    return "layers" in parts and "visual" not in parts and "vision_tower" not in parts
