import pytest

from mmserve.testing.checkpoints.llama import build_llama


@pytest.fixture(scope="session")
def e2e_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama (GQA) with its byte-level BPE tokenizer, in the published layout."""
    return build_llama(str(tmp_path_factory.mktemp("e2e_llama")))
