"""In-process generation: the engine without any server, for tests, examples and offline batch jobs. It lives in
`mmserve/` because it tokenizes (`mmserve.prep.tokenizers`): imports flow mmserve -> language."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from language.config import EngineConfig
from language.engine import EngineCore
from language.request import MultimodalItem, Request
from language.sampling_params import SamplingParams
from mmserve.prep.tokenizers import load_tokenizer  # HF tokenizers, or Qwen-VL's qwen.tiktoken
from mmserve.prep.tokenizers.grammar_vocab import grammar_vocabulary


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str | None = None


class LLM:
    def __init__(self, model_dir: str, **engine_kwargs):
        cfg = EngineConfig(model_dir=model_dir, **engine_kwargs)
        self.engine = EngineCore(cfg, grammar_vocabulary(model_dir, cfg.trust_remote_code))
        self._ids = itertools.count()
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:  # loaded on first use: token-id prompts need none
            self._tokenizer = load_tokenizer(self.engine.cfg.model_dir, self.engine.cfg.trust_remote_code)
        return self._tokenizer

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        mm_items: list[list[MultimodalItem]] | None = None,
    ) -> list[Generation]:
        """Run all prompts together (continuous batching) and return one Generation per prompt, in order."""
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = []
        for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
            items = mm_items[i] if mm_items else []
            reqs.append(Request(rid=f"llm-{next(self._ids)}", prompt_ids=ids, params=p.validate(), mm_items=items))
        self.run(reqs)
        as_text = isinstance(prompts[0], str) if prompts else False
        return [
            Generation(
                prompt_ids=r.prompt_ids,
                token_ids=r.output_ids,
                logprobs=r.output_logprobs,
                finish_reason=r.finish_reason or "",
                text=self.tokenizer.decode(r.output_ids, skip_special_tokens=True) if as_text else None,
            )
            for r in reqs
        ]

    def run(self, reqs: list[Request]) -> list[Request]:
        """Add the requests and step the engine until all of them finish."""
        for r in reqs:
            self.engine.add_request(r)
        while any(not r.finished for r in reqs):
            self.engine.step()
        return reqs
