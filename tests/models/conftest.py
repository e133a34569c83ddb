import pytest

from mmserve.testing.checkpoints.llama import build_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama with GQA (4 query heads, 2 KV heads) in the published sharded-safetensors layout."""
    return build_llama(str(tmp_path_factory.mktemp("tiny_llama")))
