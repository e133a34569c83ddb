"""Qwen2-VL prompts: each `<|image_pad|>` (written as `<|vision_start|><|image_pad|><|vision_end|>`) expands to its
image's token count, which dynamic resolution makes size-dependent, and each `<|video_pad|>` to its video's (the
frames the checkpoint's video processor samples, the vision model's `video_planner`: families/qwen2_vl_video.py, for
Qwen3-VL families/qwen3_vl_video.py, whose `<t seconds>` go before each temporal patch's own run); the engine derives
the 3-D M-RoPE positions from the grids.

The image processor's `smart_resize` refuses an aspect ratio above 200:1 (it raises, in transformers' Qwen2-VL,
Qwen2.5-VL and Qwen3-VL processors alike): `check_image_size` refuses such an image from its header, with a 400,
before the prompt is expanded or anything is encoded."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import AutoConfig, PreTrainedTokenizerBase, Qwen2VLImageProcessor, Qwen2VLVideoProcessor
from transformers.video_utils import VideoMetadata

from families import family
from families.qwen2_vl_grid import Qwen2VLGrid
from families.qwen2_vl_video import VideoPlan, plan_video
from mmserve.http.protocol import BadRequest
from mmserve.prep.multimodal.prompt import (
    MAX_ASPECT_RATIO,
    MultimodalPrompt,
    check_aspect_ratio,
    check_image_count,
)

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_END = "<|vision_end|>"


class Qwen2VLPromptProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        image_token_id: int,
        vision_start_token_id: int,
        patch_size: int,
        merge_size: int,
        min_pixels: int,
        max_pixels: int,
        video_token_id: int | None = None,
        video_processor: Qwen2VLVideoProcessor | None = None,
        video_planner: Callable = plan_video,
    ) -> None:
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.vision_start_token_id = vision_start_token_id
        self.grid = Qwen2VLGrid(patch_size, merge_size, min_pixels, max_pixels)
        self.video_token_id = video_token_id
        self.video_processor = video_processor
        self.video_planner = video_planner

    @classmethod
    def from_pretrained(cls, model_dir: str, tokenizer: PreTrainedTokenizerBase) -> Qwen2VLPromptProcessor:
        config = AutoConfig.from_pretrained(model_dir)
        processor = Qwen2VLImageProcessor.from_pretrained(model_dir)
        # The family's vision model names the video processor it reads videos with (None: no video served).
        vision = family(config.architectures[0]).part("vision")
        return cls(
            tokenizer,
            config.image_token_id,
            config.vision_start_token_id,
            processor.patch_size,
            processor.merge_size,
            processor.size.shortest_edge,
            processor.size.longest_edge,
            getattr(config, "video_token_id", None),
            vision.load_video_processor(model_dir),
            vision.video_planner,
        )

    def check_image_size(self, width: int, height: int) -> None:
        check_aspect_ratio(width, height, MAX_ASPECT_RATIO, "the most this model's image processor accepts")

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """The patch grid the image processor will produce for an image of this size (it resizes the same way)."""
        return self.grid.grid_thw(width, height)

    def count_videos(self, prompt: str) -> int:
        return prompt.count(VIDEO_PAD)

    def count_images(self, prompt: str) -> int:
        if self.video_processor is None and VIDEO_PAD in prompt:  # a family whose videos are not served here
            raise BadRequest("inputs", f"video input is not supported: the prompt has {VIDEO_PAD} (images only)")
        return prompt.count(IMAGE_PAD)

    def default_video_sampling(self) -> dict:
        """The checkpoint's video processor's own sampling setting (fps or num_frames), {} if it sets none."""
        vp = self.video_processor
        if vp is None:
            return {}
        return {"num_frames": vp.num_frames} if vp.num_frames is not None else ({"fps": vp.fps} if vp.fps else {})

    def plan_video(self, metadata: VideoMetadata, sampling: dict) -> VideoPlan:
        if self.video_processor is None:
            raise ValueError("this model's videos are not served")
        return self.video_planner(self.video_processor, metadata, sampling)

    def encode(
        self, prompt: str, image_sizes: list[tuple[int, int]], videos: Sequence[VideoPlan] = ()
    ) -> MultimodalPrompt:
        check_image_count(self.count_images(prompt), len(image_sizes), IMAGE_PAD)
        check_image_count(self.count_videos(prompt), len(videos), VIDEO_PAD)
        ids = self.tokenizer.encode(prompt)
        kinds = {self.image_token_id: 0, self.video_token_id: 1}
        pads = [(i, kinds[t]) for i, t in enumerate(ids) if t in kinds]
        check_image_count(sum(1 for _, video in pads if not video), len(image_sizes), IMAGE_PAD)
        check_image_count(sum(1 for _, video in pads if video), len(videos), VIDEO_PAD)
        image_grids = iter([self.grid_thw(w, h) for w, h in image_sizes])
        next_image, next_video = iter(range(len(image_sizes))), iter(range(len(videos)))
        token_ids: list[int] = []
        out = MultimodalPrompt(token_ids=token_ids, offsets=[], num_tokens=[])
        prev = 0
        for pad, video in pads:
            token_ids += ids[prev:pad]
            prev = pad + 1
            if video:
                index = next(next_video)
                self._add_video(out, videos[index], len(image_sizes) + index)
            else:
                self._add_run(out, ids[pad], next(image_grids), None, next(next_image))
        token_ids += ids[prev:]
        # The grids travel with the references; the engine derives the M-RoPE positions from them.
        return out

    def _add_run(self, out: MultimodalPrompt, pad_id: int, grid, seconds: float | None, source: int,
                 row_start: int = 0) -> None:  # fmt: skip
        """One run of placeholder tokens at the end of out.token_ids: rows row_start.. of item `source`."""
        count = self.grid.grid_tokens(grid)
        out.offsets.append(len(out.token_ids))
        out.token_ids += [pad_id] * count
        out.num_tokens.append(count)
        out.grid_thw.append(grid)
        out.sources.append(source)
        out.second_per_grid_t.append(seconds)
        out.row_starts.append(row_start)

    def _add_video(self, out: MultimodalPrompt, plan: VideoPlan, source: int) -> None:
        """A video's placeholder tokens: one run for the whole video, or (a plan with timestamps: Qwen3-VL, as
        Qwen3VLProcessor expands `<|video_pad|>`) per temporal patch `<t seconds><|vision_start|>` + its run +
        `<|vision_end|>`, each run a (1, h, w) grid on M-RoPE as an image's (HF's get_rope_index splits the grid)."""
        if not plan.timestamps:
            self._add_run(out, self.video_token_id, plan.grid_thw, plan.second_per_grid_t, source)
            return
        _, h, w = plan.grid_thw
        frame_tokens = self.grid.grid_tokens((1, h, w))
        vision_end = self.tokenizer.convert_tokens_to_ids(VISION_END)
        for k, seconds in enumerate(plan.timestamps):
            out.token_ids += self.tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
            out.token_ids.append(self.vision_start_token_id)
            self._add_run(out, self.video_token_id, (1, h, w), None, source, k * frame_tokens)
            out.token_ids.append(vision_end)
