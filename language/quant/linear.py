"""The FP8 linear layer of the decoder, and the swap of the model's bf16 linears for it.

`Fp8Linear` holds an e4m3 weight [N, K] and its fp32 scales [N, G], named as checkpoints name them
(`weight_scale_inv` for block-wise FP8 checkpoints, `weight_scale` for per-channel ones and for weights quantized at
load), so checkpoint tensors load by name. Under tensor parallelism the scales follow the weight rows: a
column-parallel layer's rows are this rank's output channels, scales included; a row-parallel layer (o_proj,
down_proj) keeps every output row, so its scales stay whole (quantized at load: each row's largest magnitude over
all ranks' columns), and its partial sums are reduced in fp32 and rounded once, as `RowParallelLinear`'s. Its
activations are quantized per token over this rank's columns (a scale over the whole row would cost a collective per
layer), so tp=N's FP8 results differ from tp=1's a little more than bf16's do. The embedding and
norms stay in the model's dtype; the LM head only with --quant_lm_head (language/quant/head.py).

A per-channel layer says the `input_form` it takes: the model has the norm or gated activation before it write its
input quantized per token (`QuantizedRows`), the values the layer would quantize itself, so no kernel re-reads them;
in decode batches only rows that one program of their producer holds, else the rows with their largest magnitudes
(`MeasuredRows`); unless --disable_fp8_fused_quant.
Block-wise layers quantize per 128 columns themselves."""

from __future__ import annotations

import torch
from torch import nn

from language.kernels.fp8_quant import InputForm
from language.kernels.skinny_launches import SKINNY_MAX_ROWS
from language.parallel.group import TPGroup
from language.parallel.layers import Linear, RowParallelLinear
from language.quant.fp8 import FP8_DTYPE, MeasuredRows, QuantizedRows, fp8_linear, quantize_weight, weight_scales
from language.quant.scheme import QuantScheme

# The widest decode row a producer quantizes in one pass of one program. Quantized there, a 7B layer's q/k/v GEMV
# took 8.7 against 10.0 us and gate/up's 47.5 against 50.6 us on an H100 (docs/performance.md): quantizing inside
# the GEMV puts a multiply and a rounding per column on every program's path to its first product.
ONE_PASS_COLUMNS = 4096


class Fp8Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: QuantScheme,
        bias: torch.Tensor | None = None,
        tp: TPGroup | None = None,
        fused_quant: bool = True,
    ) -> None:
        """tp: the group of a row-parallel layer (None: a column-parallel or unsharded one). fused_quant: ask for
        inputs quantized by their producer where the scheme quantizes them per token."""
        super().__init__()
        self.fused_quant = fused_quant and scheme.block is None
        self.in_features, self.out_features = in_features, out_features
        self.scale_name = scheme.scale_name
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        scales = torch.ones(out_features, scheme.scale_groups(in_features), dtype=torch.float32)
        self.register_parameter(self.scale_name, nn.Parameter(scales, requires_grad=False))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.tp = tp

    def input_form(self, rows: int) -> InputForm:
        """Prompt steps: rows quantized by their producer (a 1024-token step took 23.3 against 27.1 ms on an H100, a
        4096-token one 76.4 against 78.2 ms). Decode batches (up to SKINNY_MAX_ROWS rows): quantized too where one
        program of the producer holds a whole row (up to ONE_PASS_COLUMNS: the norms before q/k/v and gate/up), so
        the GEMV or GEMM only streams its weights; a wider row (down's) with its largest magnitude measured, since
        the gated activation spreads it over programs that never see the whole row (quantize_measured's programs
        then quantize it, many to a row). Against each linear quantizing its own rows: 4.17 against 4.34 ms a step
        at batch 16, 5.52 against 5.73 at 64 (docs/performance.md)."""
        if not self.fused_quant:
            return InputForm.PLAIN
        if rows > SKINNY_MAX_ROWS:
            return InputForm.QUANTIZED
        return InputForm.QUANTIZED if self.in_features <= ONE_PASS_COLUMNS else InputForm.MEASURED

    @property
    def scales(self) -> torch.Tensor:
        return self._parameters[self.scale_name]

    def forward(self, x: torch.Tensor | QuantizedRows | MeasuredRows) -> torch.Tensor:
        """x [..., K] in the model's dtype, or rows [n, K] quantized per token or measured -> [..., N] / [n, N]."""
        if isinstance(x, QuantizedRows):
            return self._linear(x, x.dtype)
        if isinstance(x, MeasuredRows):
            return self._linear(x, x.x.dtype)
        rows = x.reshape(-1, x.shape[-1])  # [n, K]
        return self._linear(rows, x.dtype).view(*x.shape[:-1], self.out_features)

    def _linear(self, rows: torch.Tensor | QuantizedRows | MeasuredRows, dtype: torch.dtype) -> torch.Tensor:
        if self.tp is None or not self.tp.enabled:
            return fp8_linear(rows, self.weight, self.scales, self.bias)
        # this rank's columns' partial sums, reduced in fp32 and rounded once
        partial = fp8_linear(rows, self.weight, self.scales, out_dtype=torch.float32)
        return self.tp.all_reduce(partial).to(dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scales={tuple(self.scales.shape)}"


def swap_linears(model: nn.Module, scheme: QuantScheme, quantize: bool, fused_quant: bool = True) -> int:
    """Replace every linear of the decoder layers (q/k/v, o, gate/up, down; not lm_head) by an Fp8Linear, in place.
    quantize: from the loaded weights (per output channel, repeated over the scheme's column groups: random weights
    of a block-wise scheme, --load_format dummy); else empty, for an FP8 checkpoint's tensors to load into. Each
    bf16 weight is dropped as its layer is swapped. fused_quant: Fp8Linear's. Returns how many were swapped."""
    swapped = 0
    for layer in model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) not in (Linear, RowParallelLinear):
                    continue
                setattr(parent, name, _fp8_of(child, scheme, quantize, fused_quant))
                swapped += 1
    return swapped


def _fp8_of(linear: Linear, scheme: QuantScheme, quantize: bool, fused_quant: bool) -> Fp8Linear:
    weight = linear.weight
    with torch.device(weight.device):
        tp = getattr(linear, "tp", None)
        fp8 = Fp8Linear(linear.in_features, linear.out_features, scheme, linear.bias, tp, fused_quant)
    if quantize:
        scales = weight_scales(weight.detach())
        if fp8.tp is not None:  # a row-parallel shard: each row's scale over the whole row, as at tp=1
            fp8.tp.all_reduce_max(scales)
        q, scales = quantize_weight(weight.detach(), scales)
        fp8.weight.data.copy_(q)
        fp8.scales.data.copy_(scales.expand_as(fp8.scales))  # one scale per row, repeated over any column groups
    return fp8
