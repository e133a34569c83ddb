"""Qwen2-VL's vision tower + 2x2 patch merger: transformers' own module, the checkpoint's vision weights, and its
dynamic-resolution image processor (smart_resize to multiples of 28 within min/max pixels)."""

from __future__ import annotations

import json
import os

import torch
from PIL import Image
from transformers import AutoConfig, Qwen2VLImageProcessor
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from families.qwen2_vl_grid import Qwen2VLGrid
from visual.models.base import ImageInput
from visual.models.fused_layers import use_fused_layers
from visual.models.packed_attention import pack_index
from visual.models.weights import load_prefixed_tensors
from visual.staging import HostStaging

# Published checkpoints name the tower `visual.*`; transformers >= 4.52 saves it as `model.visual.*`.
VISION_PREFIXES = ("visual.", "model.visual.")


class Qwen2VLPreprocessor:
    """Picklable image -> ImageInput (the processor holds no weights), run in the visual process's worker pool.

    transformers' processor is split in two, each half its own calls. Here, on the CPU: the image as a uint8 tensor,
    resized to its grid. The resize stays on the CPU because only there is it the processor's native uint8 kernel; on
    CUDA torchvision resizes in float, up to 22 levels away. Where the tower is (`to_patches`): rescale, normalize and
    patchify, float work whose output is 8x the uint8 image's bytes (19 MB at 896 px)."""

    def __init__(self, processor: Qwen2VLImageProcessor, merge_size: int) -> None:
        self.processor = processor
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

    def to_patches(self, resized: list[torch.Tensor]) -> torch.Tensor:
        """The processor's other steps for `__call__`'s images, on their device: [patches, C*T*P*P] float32."""
        out = self.processor(images=resized, do_resize=False, input_data_format="channels_first", return_tensors="pt")
        return out["pixel_values"]


class Qwen2VLVisionModel:
    # What a subclass for a later Qwen-VL generation changes: its tower class and its names.
    tower_class = Qwen2VisionTransformerPretrainedModel
    family = "qwen2_vl"  # in the cache salt
    display_name = "Qwen2-VL"  # in error messages

    def __init__(
        self,
        tower: Qwen2VisionTransformerPretrainedModel,
        processor: Qwen2VLImageProcessor,
        cache_salt: str,
    ) -> None:
        self.tower = tower.eval()
        use_fused_layers(self.tower)  # our attention (one varlen call per block), activation and patch embedding
        self.processor = processor
        self.cache_salt = cache_salt
        self.hidden_size: int = tower.config.hidden_size
        self.merge_size: int = tower.config.spatial_merge_size
        self._preprocessor = Qwen2VLPreprocessor(processor, self.merge_size)
        self._pixels = HostStaging()  # pinned (on CUDA) host buffer the batch's pixels are gathered into

    @classmethod
    def load_preprocessor(cls, model_dir: str, vision_tower_dir: str | None = None) -> Qwen2VLPreprocessor:
        """The preprocessor from the config files alone (the pool starts it while the tower loads)."""
        merge_size = AutoConfig.from_pretrained(model_dir).vision_config.spatial_merge_size
        return Qwen2VLPreprocessor(Qwen2VLImageProcessor.from_pretrained(model_dir), merge_size)

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
        return cls(tower.to(device=device, dtype=dtype), processor, salt)

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
        """The batch's pixels on the device, [patches, C*T*P*P]: the uint8 images gathered into one (pinned) host
        buffer, one asynchronous upload, then the processor's float steps and the cast on the device."""
        host = self._pixels.cat([im.pixel_values.reshape(-1) for im in images], device)
        uploaded = host.to(device, non_blocking=True)
        self._pixels.fence(device)  # the next batch's gather waits for this upload
        parts = torch.split(uploaded, [im.pixel_values.numel() for im in images])
        resized = [part.view(im.pixel_values.shape) for part, im in zip(parts, images, strict=True)]
        return self._preprocessor.to_patches(resized).to(dtype)

    def packed_inputs(self, grids: list[tuple[int, int, int]], device: torch.device) -> dict:
        """The tower's keyword arguments for a batch packed into one sequence, built on the host (no per-image device
        work, no sync). `grid_thw` [images, 3] is unused by the tower when the indexes are given."""
        index = pack_index(grids, self.merge_size)
        return dict(
            grid_thw=torch.tensor(grids),
            cu_seqlens=index.cu_seqlens.to(device, non_blocking=True),
            max_seqlen=index.max_seqlen,
            position_ids=index.position_ids.to(device, non_blocking=True),
        )

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        device, dtype = self.tower.get_device(), self.tower.get_dtype()
        grids = [im.grid_thw for im in images]
        pixels = self.upload_pixels(images, device, dtype)
        merged = self.tower(pixels, **self.packed_inputs(grids, device)).pooler_output  # [sum of tokens, hidden]
        return list(torch.split(merged, [im.num_tokens for im in images]))
