"""Qwen2-VL's vision tower + 2x2 patch merger: transformers' own module, the checkpoint's vision weights, and its
dynamic-resolution image processor (smart_resize to multiples of 28 within min/max pixels)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, Qwen2VLImageProcessor, Qwen2VLVideoProcessor
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from families.qwen2_vl_grid import Qwen2VLGrid
from families.qwen2_vl_video import plan_video, size_of
from visual.models.base import ImageInput
from visual.models.fused_layers import use_fused_layers
from visual.models.packed_attention import pack_index
from visual.models.weights import load_prefixed_tensors
from visual.staging import HostStaging
from visual.tower_graphs import TowerGraphs
from visual.video_decode import BadVideo, probe_video, read_frames

# Published checkpoints name the tower `visual.*`; transformers >= 4.52 saves it as `model.visual.*`.
VISION_PREFIXES = ("visual.", "model.visual.")


class Qwen2VLPreprocessor:
    """Picklable image -> ImageInput and video file -> ImageInput (the processors hold no weights), run in the visual
    process's worker pool.

    For an image, transformers' processor is split in two, each half its own calls. Here, on the CPU: the image as a
    uint8 tensor, resized to its grid. The resize stays on the CPU because only there is it the processor's native
    uint8 kernel; on CUDA torchvision resizes in float, up to 22 levels away. Where the tower is (`to_patches`):
    rescale, normalize and patchify, float work whose output is 8x the uint8 image's bytes (19 MB at 896 px). A video
    runs its whole video processor here (its frames come out as float patches)."""

    def __init__(
        self,
        processor: Qwen2VLImageProcessor,
        merge_size: int,
        video_processor: Qwen2VLVideoProcessor | None = None,
        video_planner: Callable = plan_video,
    ) -> None:
        self.processor = processor
        self.video_processor = video_processor
        self.video_planner = video_planner  # the family's frame sampling and grid (its vision model's video_planner)
        self.grid = Qwen2VLGrid(
            processor.patch_size, merge_size, processor.size.shortest_edge, processor.size.longest_edge
        )

    def __call__(self, image: Image.Image) -> ImageInput:
        processor = self.processor
        chw = processor.process_image(image, do_convert_rgb=processor.do_convert_rgb)  # [3, H, W] uint8
        resized = processor.resize(
            chw, size=processor.size, resample=processor.resample, factor=processor.patch_size * processor.merge_size
        )
        grid = (1, resized.shape[-2] // processor.patch_size, resized.shape[-1] // processor.patch_size)  # as patchify
        return ImageInput(
            pixel_values=resized,  # [3, grid h * patch, grid w * patch] uint8
            num_tokens=self.grid.grid_tokens(grid),
            patches=grid[0] * grid[1] * grid[2],
            grid_thw=grid,
        )

    def video(self, data: bytes, sampling: dict) -> ImageInput:
        """A video file -> the tower's input: the frames the checkpoint's video processor samples (`sampling`: the
        request's effective parameters, families/qwen2_vl_video.py), decoded and preprocessed by it. The frames are
        already sampled here, so the processor runs with do_sample_frames False."""
        metadata = probe_video(data)
        try:
            plan = self.video_planner(self.video_processor, metadata, sampling)
        except ValueError as e:
            raise BadVideo(str(e)) from None
        frames = read_frames(data, np.asarray(plan.indices))
        out = self.video_processor(
            videos=[frames], do_sample_frames=False, size=size_of(self.video_processor, sampling), return_tensors="pt"
        )
        grid = tuple(int(x) for x in out["video_grid_thw"][0])
        if grid != plan.grid_thw:  # the prompt was expanded for plan.grid_thw
            raise RuntimeError(f"the video processor made a {grid} grid, not the planned {plan.grid_thw}")
        return ImageInput(
            pixel_values=out["pixel_values_videos"],  # [t*h*w patches, 3 * temporal_patch * patch * patch]
            num_tokens=self.grid.grid_tokens(grid),
            patches=grid[0] * grid[1] * grid[2],
            grid_thw=grid,
        )

    def to_patches(self, resized: list[torch.Tensor]) -> torch.Tensor:
        """The processor's other steps for `__call__`'s images, on their device: [patches, C*T*P*P] float32."""
        out = self.processor(images=resized, do_resize=False, input_data_format="channels_first", return_tensors="pt")
        return out["pixel_values"]


class Qwen2VLVisionModel:
    # What a subclass for a later Qwen-VL generation changes: its tower class and its names.
    tower_class = Qwen2VisionTransformerPretrainedModel
    family = "qwen2_vl"  # in the cache salt
    display_name = "Qwen2-VL"  # in error messages
    video_processor_class: type | None = Qwen2VLVideoProcessor  # None: the family serves no video here
    # (video processor, metadata, sampling) -> VideoPlan: what that processor makes of a video
    video_planner: Callable = staticmethod(plan_video)

    @classmethod
    def load_video_processor(cls, model_dir: str) -> Qwen2VLVideoProcessor | None:
        """The checkpoint's video processor (video_preprocessor_config.json, processor_config.json's nested one, else
        its image processor's config); with none of them, the class's defaults, as HF's processor then builds it."""
        if cls.video_processor_class is None:
            return None
        try:
            return cls.video_processor_class.from_pretrained(model_dir)
        except OSError:
            return cls.video_processor_class()

    def __init__(
        self,
        tower: Qwen2VisionTransformerPretrainedModel,
        processor: Qwen2VLImageProcessor,
        cache_salt: str,
        video_processor: Qwen2VLVideoProcessor | None = None,
    ) -> None:
        self.tower = tower.eval()
        use_fused_layers(self.tower)  # our attention (one varlen call per block), activation and patch embedding
        self.processor = processor
        self.cache_salt = cache_salt
        self.hidden_size: int = tower.config.hidden_size
        self.merge_size: int = tower.config.spatial_merge_size
        self._preprocessor = Qwen2VLPreprocessor(processor, self.merge_size, video_processor, self.video_planner)
        self._pixels = HostStaging()  # pinned (on CUDA) host buffer the batch's pixels are gathered into
        self.graphs: TowerGraphs | None = None  # `enable_cuda_graphs`

    @classmethod
    def load_preprocessor(cls, model_dir: str, vision_tower_dir: str | None = None) -> Qwen2VLPreprocessor:
        """The preprocessor from the config files alone (the pool starts it while the tower loads)."""
        merge_size = AutoConfig.from_pretrained(model_dir).vision_config.spatial_merge_size
        return Qwen2VLPreprocessor(
            Qwen2VLImageProcessor.from_pretrained(model_dir), merge_size, cls.load_video_processor(model_dir),
            cls.video_planner,
        )  # fmt: skip

    @classmethod
    def from_pretrained(
        cls, model_dir: str, device: torch.device, dtype: torch.dtype, dummy: bool = False
    ) -> Qwen2VLVisionModel:
        """dummy: keep the random init (--load_format dummy), reading no weights."""
        config = AutoConfig.from_pretrained(model_dir)  # flat (published) or nested (transformers 5) config.json
        # Reads preprocessor_config.json, or processor_config.json's nested "image_processor".
        processor = Qwen2VLImageProcessor.from_pretrained(model_dir)
        # Built on the target device so that the (overwritten) random init is fast for 7B-sized towers.
        with torch.device(device):
            tower = cls.tower_class._from_config(config.vision_config, dtype=dtype)
        missing, unexpected = [], []
        if not dummy:
            missing, unexpected = tower.load_state_dict(load_prefixed_tensors(model_dir, VISION_PREFIXES), strict=False)
        missing = [k for k in missing if "inv_freq" not in k]  # the rotary table is computed, not stored
        if missing or unexpected:
            raise ValueError(
                f"{cls.display_name} vision weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        size = processor.size
        salt = json.dumps([cls.family, os.path.realpath(model_dir), size.shortest_edge, size.longest_edge, str(dtype)])
        return cls(tower.to(device=device, dtype=dtype), processor, salt, cls.load_video_processor(model_dir))

    def preprocessor(self) -> Qwen2VLPreprocessor:
        return self._preprocessor

    def preprocess(self, image: Image.Image) -> ImageInput:
        return self._preprocessor(image)

    def num_tokens(self, width: int, height: int) -> int:
        return self._preprocessor.grid.num_tokens(width, height)

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """The patch grid (t, h, w) of an image of this size, as the processor will resize it."""
        return self._preprocessor.grid.grid_thw(width, height)

    def upload_pixels(self, images: list[ImageInput], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The batch's pixels on the device, [patches, C*T*P*P]: every item's bytes gathered into one (pinned) host
        buffer, one asynchronous upload; then, for each run of images (uint8, resized), the processor's float steps on
        the device, while a video's float32 patches (its processor ran in the worker) are used as they come."""
        raw = [im.pixel_values.reshape(-1).view(torch.uint8) for im in images]
        host = self._pixels.cat(raw, device)
        uploaded = host.to(device, non_blocking=True)
        self._pixels.fence(device)  # the next batch's gather waits for this upload
        parts = torch.split(uploaded, [r.numel() for r in raw])
        pieces: list[torch.Tensor] = []
        resized: list[torch.Tensor] = []  # the current run of images
        for part, im in zip(parts, images, strict=True):
            shape, kind = im.pixel_values.shape, im.pixel_values.dtype
            if kind == torch.uint8:
                resized.append(part.view(shape))
                continue
            if resized:
                pieces.append(self._preprocessor.to_patches(resized))
                resized = []
            pieces.append(part.view(kind).view(shape))
        if resized:
            pieces.append(self._preprocessor.to_patches(resized))
        return torch.cat(pieces).to(dtype) if len(pieces) > 1 else pieces[0].to(dtype)

    def packed_inputs(self, grids: Sequence[tuple[int, int, int]], device: torch.device) -> dict:
        """The tower's keyword arguments for a batch packed into one sequence, built on the host (no per-image device
        work, no sync). `grid_thw` [images, 3] is unused by the tower when the indexes are given."""
        index = pack_index(grids, self.merge_size)
        return dict(
            grid_thw=torch.tensor(grids),
            cu_seqlens=index.cu_seqlens.to(device, non_blocking=True),
            max_seqlen=index.max_seqlen,
            position_ids=index.position_ids.to(device, non_blocking=True),
        )

    def tower_inputs(self, grids: Sequence[tuple[int, int, int]], device: torch.device) -> dict:
        """Everything the tower derives from the batch's grids (a later generation adds its own), on the device."""
        return self.packed_inputs(grids, device)

    def tower_forward(self, pixels: torch.Tensor, inputs: dict) -> torch.Tensor:
        """pixels [patches, C*T*P*P] -> the batch's embeddings [sum of tokens, embedding width]."""
        return self.tower(pixels, **inputs).pooler_output

    def enable_cuda_graphs(self, max_patches: int) -> None:
        """Replay CUDA graphs for batches of at most max_patches patches whose grids were seen before
        (`visual/tower_graphs.py`); CUDA only."""
        self.graphs = TowerGraphs(self.tower_forward, self.tower_inputs, max_patches)

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        weight = self.tower.patch_embed.proj.weight  # not a block's: those may be FP8 (--vit_quant_type)
        device, dtype = weight.device, weight.dtype
        grids = tuple(im.grid_thw for im in images)
        pixels = self.upload_pixels(images, device, dtype)
        if self.graphs is not None:
            embeds = self.graphs.run(grids, pixels)
        else:
            embeds = self.tower_forward(pixels, self.tower_inputs(grids, device))
        return list(torch.split(embeds, [im.num_tokens for im in images]))
