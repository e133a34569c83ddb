"""Default sampling for the OpenAI routes from the model's generation config, as vLLM's `--generation-config auto`
(its default): a request's unset `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_tokens`
take the values of the checkpoint's generation_config.json that differ from transformers' defaults (`max_new_tokens`
for `max_tokens`). `--generation_config vllm` keeps OpenAI's defaults; a folder path reads that folder's file instead;
`--override_generation_config '{"temperature": 0.5}'` sets fields over either, as vLLM's.
/generate keeps LightLLM's defaults, as LightLLM does.

Qwen publishes its recommended sampling this way (Qwen3-VL-Instruct: temperature 0.7, top-p 0.8, top-k 20), so a
chat that sets none of them is answered as on vLLM."""

from __future__ import annotations

import logging
import os

from transformers import GenerationConfig

from language.sampling_params import InvalidParams, SamplingParams

log = logging.getLogger(__name__)

# generation_config.json's field -> the OpenAI request's (vLLM's list)
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_PARAMS = {"max_tokens": "max_new_tokens"}  # the request's name -> SamplingParams' where they differ


def sampling_defaults(source: str, model_dir: str | None, overrides: dict | None = None) -> dict[str, float | int]:
    """The OpenAI request fields' defaults (by the request's names) from `source`: "auto" (the checkpoint's
    generation_config.json, if it has one), "vllm" (none) or a folder holding a generation_config.json; then
    `overrides` (vLLM's --override-generation-config: generation-config names and values, applied whatever the
    source). A value SamplingParams refuses is left out, with a warning."""
    config = _generation_config(source, model_dir)
    config.update(overrides or {})
    defaults = {name: config[key] for key, name in _FIELDS.items() if config.get(key) is not None}
    for name, value in list(defaults.items()):
        try:
            SamplingParams(**{_PARAMS.get(name, name): value}).validate()
        except (InvalidParams, TypeError) as e:
            log.warning("generation config's %s (%r) is not used as a default: %s", name, value, e)
            del defaults[name]
    if defaults:
        log.info("the OpenAI routes' default sampling, from the generation config: %s (--generation_config vllm: "
                 "OpenAI's defaults)", defaults)  # fmt: skip
    return defaults


def _generation_config(source: str, model_dir: str | None) -> dict:
    """The fields of `source`'s generation_config.json that differ from transformers' defaults ({} for none)."""
    if source == "vllm":
        return {}
    folder = model_dir if source == "auto" else source
    if not folder or not os.path.isfile(os.path.join(folder, "generation_config.json")):
        if source != "auto":
            raise ValueError(f"--generation_config {source}: no generation_config.json there")
        return {}
    try:
        return GenerationConfig.from_pretrained(folder).to_diff_dict()
    except (OSError, ValueError) as e:  # not JSON, or values transformers refuses
        log.warning("%s/generation_config.json is not read for default sampling: %s", folder, e)
        return {}
