"""The children skip transformers' import-time class docstrings (seconds of imports they do not need)."""

import subprocess
import sys

CHILD = """
from visual.hf_imports import skip_docstring_generation
skip_docstring_generation()
import importlib
auto_docstring = importlib.import_module("transformers.utils.auto_docstring")
class Probe:
    "mine"
assert auto_docstring.auto_class_docstring(Probe) is Probe and Probe.__doc__ == "mine"
from transformers import AutoConfig
config = AutoConfig.for_model("qwen2_vl")
assert config.get_text_config().hidden_size > 0  # configs still load, with their defaults
"""


def test_a_process_that_skips_them_still_loads_configs():
    subprocess.run([sys.executable, "-c", CHILD], check=True, timeout=120)
