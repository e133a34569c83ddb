"""Gemma 3 prompts: each `<start_of_image>` in the prompt (the chat template writes one per image) is one image, in
order, and becomes Gemma3Processor's full image sequence, `\\n\\n<start_of_image>` + `mm_tokens_per_image` x
`<image_soft_token>` + `<end_of_image>\\n\\n`. The text is expanded as the processor expands it and then tokenized
whole, so the newlines merge with their neighbours exactly as in HF's ids; each image's embeddings go at its run of
soft tokens (their id, as HF's, is overwritten by the embeddings)."""

from __future__ import annotations

from transformers import AutoProcessor, PreTrainedTokenizerBase

from mmserve.prep.multimodal.prompt import MultimodalPrompt, check_image_count


class Gemma3PromptProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, processor) -> None:
        self.tokenizer = tokenizer
        self.image_text = processor.boi_token  # <start_of_image>
        self.full_image_sequence = processor.full_image_sequence
        self.tokens_per_image = processor.image_seq_length
        self.soft_id = tokenizer.convert_tokens_to_ids(processor.tokenizer.image_token)

    @classmethod
    def from_pretrained(cls, model_dir: str, tokenizer: PreTrainedTokenizerBase) -> Gemma3PromptProcessor:
        return cls(tokenizer, AutoProcessor.from_pretrained(model_dir))

    def count_images(self, prompt: str) -> int:
        return prompt.count(self.image_text)

    def encode(self, prompt: str, image_sizes: list[tuple[int, int]]) -> MultimodalPrompt:
        check_image_count(self.count_images(prompt), len(image_sizes), self.image_text)
        ids = self.tokenizer.encode(prompt.replace(self.image_text, self.full_image_sequence))
        offsets = [i for i, t in enumerate(ids) if t == self.soft_id and (i == 0 or ids[i - 1] != self.soft_id)]
        check_image_count(len(offsets), len(image_sizes), self.image_text)
        return MultimodalPrompt(token_ids=ids, offsets=offsets, num_tokens=[self.tokens_per_image] * len(offsets))
