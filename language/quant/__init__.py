"""Weight and activation quantization of the language model's linear layers (FP8 e4m3): the arithmetic
(fp8.py), the layer that holds quantized weights (linear.py) and which scheme a model runs (scheme.py)."""
