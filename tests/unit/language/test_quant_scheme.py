"""Which quantization the decoder runs (language/quant/scheme.py): --quant_type and its vLLM alias, the published FP8
layouts read from config.json, and the checkpoints refused at start with a message saying why."""

import pytest

from language.options import EngineOptions
from language.quant.scheme import QuantScheme, quant_scheme
from mmserve.testing.checkpoints.fp8 import block_config, channel_config


def test_quant_type_and_its_vllm_alias():
    assert EngineOptions(quant_type="fp8").quant_type == "fp8w8a8"
    assert EngineOptions().quant_type == "none"
    with pytest.raises(ValueError, match="--quant_type"):
        EngineOptions(quant_type="int4")
    assert quant_scheme("none", {}) is None
    assert quant_scheme("fp8w8a8", {}) == QuantScheme(prequantized=False, scale_name="weight_scale")


def test_published_layouts_apply_whatever_the_flag_says():
    block = quant_scheme("none", {"quantization_config": block_config()})
    assert block == QuantScheme(prequantized=True, scale_name="weight_scale_inv", block=(128, 128))
    assert block.scale_groups(300) == 3
    nested = quant_scheme("fp8w8a8", {"text_config": {"quantization_config": channel_config()}})
    assert nested == QuantScheme(prequantized=True, scale_name="weight_scale")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"activation_scheme": "static"}, "static activation scales"),
        ({"weight_block_size": None}, "per-tensor"),
        ({"fmt": "e5m2"}, "only e4m3"),
        ({"modules_to_not_convert": ["lm_head", "model.language_model.layers.0.mlp.down_proj"]}, "decoder layers"),
        ({"quant_method": "awq"}, "only fp8 and compressed-tensors"),
    ],
)
def test_checkpoints_not_served_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        quant_scheme("none", {"quantization_config": {**block_config(), **change}})


def test_compressed_tensors_other_than_fp8_dynamic_are_refused():
    config = channel_config()
    config["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(ValueError, match="only FP8-dynamic"):
        quant_scheme("none", {"quantization_config": config})
