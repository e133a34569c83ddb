"""InternVL in the transformers-native layout (`InternVLForConditionalGeneration`, InternVL3's Qwen2 language model
with its q/k/v biases) through the engine at tp=2 on gloo: one image, two images of different tile counts (their
rows reach rank 1 through the step's broadcast, in 32-token prefill chunks) and text alone give HF's greedy tokens.
The engine rather than the server keeps it cheap: the server's --tp 2 path is covered by tests/e2e/test_tp_server.py
on the remote-code layout (InternLM2) and on Gemma 3."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoProcessor, AutoTokenizer, InternVLForConditionalGeneration

from language.request import MultimodalItem
from mmserve.testing.checkpoints.internvl import build_internvl_hf
from tests.models.test_internvl import IMAGES, NEW_TOKENS, PROMPTS, hf_greedy
from tests.parallel.ranks import run_ranks
from visual.models.internvl import MIN_TRANSFORMERS, InternVLVisionModel

ARCH = "InternVLForConditionalGeneration"

pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < Version(MIN_TRANSFORMERS),
    reason=f"InternVL needs transformers >= {MIN_TRANSFORMERS}",
)


def _generate_on_rank(rank: int, init_method: str, model_dir: str, prompts: list[list[int]], items: list[list]):
    from language.config import EngineConfig
    from language.parallel.worker import TPWorker
    from language.sampling_params import SamplingParams
    from mmserve.llm import LLM

    kwargs = dict(max_total_token_num=2048, device="cpu", data_type="float32", tp=2, dist_init_method=init_method,
                  chunked_prefill_size=32)  # fmt: skip
    if rank:
        TPWorker(EngineConfig(model_dir=model_dir, **kwargs), rank).serve()
        return None
    llm = LLM(model_dir, **kwargs)
    out = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), mm_items=items)
    llm.engine.close()
    return [g.token_ids for g in out]


def _our_inputs(model_dir: str) -> tuple[list[list[int]], list[list[MultimodalItem]]]:
    """Each prompt's ids and image rows, from our prompt processor and vision model (as the server's processes)."""
    from mmserve.prep.multimodal.prompt import prompt_processor_class

    prompter = prompt_processor_class(ARCH).from_pretrained(model_dir, AutoTokenizer.from_pretrained(model_dir))
    vision = InternVLVisionModel.from_pretrained(model_dir, torch.device("cpu"), torch.float32)
    embeds = vision.encode([vision.preprocess(im) for im in IMAGES])
    prompts, items = [], []
    for text, image_ids in PROMPTS:
        mm = prompter.encode(text, [IMAGES[i].size for i in image_ids])
        prompts.append(mm.token_ids)
        items.append([MultimodalItem(o, embeds[i]) for o, i in zip(mm.offsets, image_ids, strict=True)])
    return prompts, items


def test_internvl_hf_tp2_equals_hf(tmp_path):
    model_dir = build_internvl_hf(str(tmp_path / "internvl"))
    prompts, items = _our_inputs(model_dir)
    ours = run_ranks(_generate_on_rank, model_dir, prompts, items)
    processor = AutoProcessor.from_pretrained(model_dir)
    hf = InternVLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    for (text, image_ids), prompt, got in zip(PROMPTS, prompts, ours, strict=True):
        inputs = processor(text=text, images=[IMAGES[i] for i in image_ids] or None, return_tensors="pt")
        assert prompt == inputs["input_ids"][0].tolist(), text
        assert got == hf_greedy(hf, inputs), text
