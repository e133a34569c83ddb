"""Images that try to hurt the server or confuse the pipeline (issue 10, abuse): decompression bombs refused from
the header before any pixel is decoded, formats outside the accepted list, multi-frame files (frame 0 only), modes
other than RGB converted exactly as HF's image processors do, and the per-request caps through the preparer."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from transformers import AutoImageProcessor

from mmserve.http.protocol import BadRequest
from mmserve.launch.cli import parse_config
from mmserve.launch.config import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES_PER_REQUEST
from mmserve.prep.multimodal.image_io import BadImage, ImagePolicy, load_image
from mmserve.prep.multimodal.preparer import MultimodalPreparer
from mmserve.prep.multimodal.prompt import MultimodalPrompt
from mmserve.prep.tokenization import MultimodalInput
from mmserve.testing.checkpoints.llava import build_llava_hf
from mmserve.testing.checkpoints.qwen2_vl import build_qwen2_vl
from visual.image_decode import open_image
from visual.models.llava import LlavaPreprocessor, LlavaVisionModel
from visual.models.qwen2_vl import Qwen2VLVisionModel
from visual.preprocess import PreprocessPool, decode_and_preprocess, rgb_conversion, to_rgb


def encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def b64(data: bytes) -> dict:
    return {"type": "base64", "data": base64.b64encode(data).decode()}


def bomb_png(width: int, height: int) -> bytes:
    """A ~60-byte PNG whose header (valid CRC) declares width x height RGB pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    idat = zlib.compress(b"\x00" * 16)
    idat_chunk = struct.pack(">I", len(idat)) + b"IDAT" + idat + struct.pack(">I", zlib.crc32(b"IDAT" + idat))
    return b"\x89PNG\r\n\x1a\n" + chunk + idat_chunk + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", 0xAE426082)


# ---- decompression bombs ----


@pytest.fixture
def no_decoding(monkeypatch):
    """Fails the test's expectations if any image decoder runs (ImageFile.load is where PIL decodes pixels)."""
    calls = []
    original = ImageFile.ImageFile.load

    def load(self):
        calls.append(self.size)
        return original(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return calls


@pytest.mark.parametrize(
    "width, height, max_pixels",
    [
        (100_000, 100_000, DEFAULT_MAX_IMAGE_PIXELS),  # 1e10 px: over PIL's own guard too
        (6_000, 6_000, DEFAULT_MAX_IMAGE_PIXELS),  # 3.6e7 px: under PIL's guard, over ours
        (200, 100, 10_000),  # a small cap set by --max_image_pixels
    ],
)
def test_a_declared_size_over_the_cap_is_refused_before_decoding(no_decoding, width, height, max_pixels):
    data = bomb_png(width, height)
    assert len(data) < 100
    with pytest.raises(BadImage, match=r"more than the limit of \d+ \(--max_image_pixels\)") as err:
        open_image(data, max_pixels)
    assert str(width * height) in str(err.value)
    assert no_decoding == []  # refused from the header: no decoder ran
    with pytest.raises(BadImage, match="--max_image_pixels"):
        load_image(b64(data), ImagePolicy(max_pixels=max_pixels))
    assert no_decoding == []


def test_an_image_at_the_cap_is_decoded(no_decoding):
    image = open_image(encode(Image.new("RGB", (100, 100), (1, 2, 3)), "PNG"), 10_000)
    assert image.size == (100, 100) and no_decoding == [(100, 100)]


def test_formats_outside_the_list_are_refused():
    """ICO entries embed PNGs whose size need not match the directory (a bomb behind a 16x16 header); EPS runs
    Ghostscript. Neither is opened."""
    ico = encode(Image.new("RGBA", (32, 32), (9, 9, 9, 255)), "ICO", sizes=[(32, 32)])
    assert Image.open(io.BytesIO(ico)).format == "ICO"  # PIL alone would open it
    with pytest.raises(BadImage, match="accepted formats: PNG, JPEG"):
        open_image(ico, DEFAULT_MAX_IMAGE_PIXELS)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n%%EOF\n"
    with pytest.raises(BadImage, match="not a readable image"):
        open_image(eps, DEFAULT_MAX_IMAGE_PIXELS)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF", "PPM", "TGA"])
def test_the_usual_formats_open(fmt):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (12, 20, 3), dtype=np.uint8))
    assert open_image(encode(image, fmt), DEFAULT_MAX_IMAGE_PIXELS).size == (20, 12)


# ---- multi-frame files: frame 0 ----


def two_frames() -> tuple[Image.Image, Image.Image]:
    """Two 40x30 frames that differ everywhere, 4 colours each (GIF palettes keep them exactly)."""
    y, x = np.mgrid[0:30, 0:40]
    first = np.where(((x // 5 + y // 5) % 2)[..., None] == 0, [255, 0, 0], [0, 0, 255]).astype(np.uint8)
    second = np.where((x < 20)[..., None], [0, 255, 0], [255, 255, 0]).astype(np.uint8)
    return Image.fromarray(first), Image.fromarray(second)


def multi_frame(fmt: str) -> tuple[bytes, bytes]:
    """(a 2-frame file, frame 0 alone in the same format)."""
    first, second = two_frames()
    if fmt == "GIF":
        first, second = first.convert("P"), second.convert("P")
    kw = {"lossless": True} if fmt == "WEBP" else {}
    both = encode(first, fmt, save_all=True, append_images=[second], **kw)
    return both, encode(first, fmt, **kw)


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "TIFF", "WEBP"])  # PNG with save_all: APNG
def test_multi_frame_files_decode_frame_0(fmt):
    both, alone = multi_frame(fmt)
    opened = Image.open(io.BytesIO(both))
    assert getattr(opened, "n_frames", 1) == 2
    ours = open_image(both, DEFAULT_MAX_IMAGE_PIXELS)
    want = np.asarray(Image.open(io.BytesIO(alone)).convert("RGB"))
    assert np.array_equal(np.asarray(ours.convert("RGB")), want)
    assert np.array_equal(want, np.asarray(two_frames()[0]))


# ---- modes, against HF's processors ----


@pytest.fixture(scope="module")
def preprocessors(tmp_path_factory):
    llava = build_llava_hf(str(tmp_path_factory.mktemp("llava_hf")))
    qwen = build_qwen2_vl(str(tmp_path_factory.mktemp("qwen2_vl")))
    return {
        "llava": (LlavaVisionModel.from_pretrained(llava, torch.device("cpu"), torch.float32), llava),
        "qwen2_vl": (Qwen2VLVisionModel.from_pretrained(qwen, torch.device("cpu"), torch.float32), qwen),
    }


def mode_images() -> dict[str, bytes]:
    rng = np.random.default_rng(3)
    rgba = rng.integers(0, 256, (30, 40, 4), dtype=np.uint8)
    rgba[:10, :, 3] = 0  # fully transparent rows, whose colour HF replaces by white
    palette = Image.fromarray(rgba[..., :3].copy()).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette_t = palette.copy()
    palette_t.info["transparency"] = 3
    return {
        "RGBA": encode(Image.fromarray(rgba, "RGBA"), "PNG"),
        "LA": encode(Image.fromarray(rgba[..., :2].copy(), "LA"), "PNG"),
        "P": encode(palette, "PNG"),
        "P+transparency": encode(palette_t, "PNG", transparency=3),
        "GIF+transparency": encode(palette_t, "GIF", transparency=3),
        "I;16": encode(Image.fromarray(rng.integers(0, 65536, (30, 40), dtype=np.uint16)), "PNG"),
        "I;16 low": encode(Image.fromarray(rng.integers(0, 256, (30, 40), dtype=np.uint16)), "PNG"),
        "CMYK": encode(Image.fromarray(rgba, "CMYK"), "JPEG", quality=95),
        "CMYK TIFF": encode(Image.fromarray(rgba, "CMYK"), "TIFF"),
        "L": encode(Image.fromarray(rgba[..., 0].copy()), "PNG"),
        "1": encode(Image.fromarray(rgba[..., 0] > 127), "PNG"),
        "RGB": encode(Image.fromarray(rgba[..., :3].copy()), "PNG"),
    }


MODES = mode_images()
EXPECTED_MODE = {"I;16 low": "I;16", "CMYK TIFF": "CMYK", "P+transparency": "P", "GIF+transparency": "P"}


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
@pytest.mark.parametrize("name", sorted(MODES))
def test_modes_are_converted_as_hf_processors_do(preprocessors, family, name):
    model, model_dir = preprocessors[family]
    data = MODES[name]
    assert Image.open(io.BytesIO(data)).mode == EXPECTED_MODE.get(name, name)
    ours = decode_and_preprocess(data, model.preprocessor())
    hf = AutoImageProcessor.from_pretrained(model_dir)(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    want = hf["pixel_values"]
    if family == "llava":
        assert torch.equal(ours.pixel_values, want[0])
    else:  # the worker's uint8 image, its float steps where the tower is
        assert torch.equal(model.upload_pixels([ours], torch.device("cpu"), torch.float32), want)


def test_transparency_goes_onto_white_for_hf_families_and_is_dropped_for_the_others(preprocessors):
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert to_rgb(rgba, "hf").getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(rgba, "pil").getpixel((0, 0)) == (10, 20, 30)
    llava = preprocessors["llava"][0].preprocessor()
    assert rgb_conversion(llava) == "hf" and rgb_conversion(preprocessors["qwen2_vl"][0].preprocessor()) == "hf"
    # The original LLaVA (pad to square) pads a PIL convert("RGB") image, as its own code does.
    padded = LlavaPreprocessor(llava.image_processor, pad_to_square=True, num_tokens=llava.num_tokens)
    assert rgb_conversion(padded) == "pil"


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_a_2_frame_gif_preprocesses_as_its_frame_0(preprocessors, family):
    model = preprocessors[family][0]
    both, alone = multi_frame("GIF")
    ours = decode_and_preprocess(both, model.preprocessor()).pixel_values
    assert torch.equal(ours, decode_and_preprocess(alone, model.preprocessor()).pixel_values)
    second = encode(two_frames()[1].convert("P"), "GIF")
    assert not torch.equal(ours, decode_and_preprocess(second, model.preprocessor()).pixel_values)


def test_the_preprocessing_pool_workers_convert_and_take_frame_0(preprocessors):
    """The visual process's path: spawned worker processes, pixels back through shared memory."""
    model = preprocessors["qwen2_vl"][0]
    pool = PreprocessPool(model, num_workers=1)
    try:
        both, alone = multi_frame("GIF")
        for data, ref in ((both, alone), (MODES["RGBA"], MODES["RGBA"]), (MODES["I;16"], MODES["I;16"])):
            got = PreprocessPool.collect(pool.submit(data)).pixel_values
            assert torch.equal(got, decode_and_preprocess(ref, model.preprocessor()).pixel_values)
    finally:
        pool.shutdown()


# ---- caps through the preparer ----


class FakePromptProcessor:
    """`<image>` placeholders, one token each; records whether images were read from the prompt."""

    def count_images(self, prompt: str) -> int:
        return prompt.count("<image>")

    def encode(self, prompt: str, sizes: list[tuple[int, int]]) -> MultimodalPrompt:
        offsets = [i for i, piece in enumerate(prompt.split("<image>")[:-1])]
        return MultimodalPrompt(list(range(len(sizes) + 1)), offsets, [1] * len(sizes), None)


class FakeQwenVLPromptProcessor(FakePromptProcessor):
    """Qwen-VL's kind: images named inside the prompt, read by image_items."""

    def __init__(self):
        self.read = 0

    def image_items(self, prompt: str, sent: list) -> list:
        self.read += 1
        raise AssertionError("images read before the count was checked")


class FakeCoordinator:
    def __init__(self):
        self.acquired: list = []

    async def acquire(self, items, videos=None, options=None):
        self.acquired.append(items)
        return [object() for _ in items]

    def release(self, entries) -> None:
        pass


async def run_sync(fn, *args):
    return await asyncio.to_thread(fn, *args)


def png_item(width: int, height: int, seed: int = 0) -> dict:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return b64(encode(Image.fromarray(pixels), "PNG"))


def prepare(preparer, prompt: str, images: list):
    return asyncio.run(preparer.prepare("r", MultimodalInput(prompt, {"images": images}), run_sync))


def test_images_per_request_cap_is_a_400_naming_the_flag():
    coordinator = FakeCoordinator()
    preparer = MultimodalPreparer(FakePromptProcessor(), coordinator, "salt", ImagePolicy(max_images=2))
    items = [png_item(8, 8, i) for i in range(3)]
    with pytest.raises(
        BadRequest, match=r"3 images in one request, more than the limit of 2 \(--max_images_per_request\)"
    ) as err:
        prepare(preparer, "<image>" * 3, items)
    assert err.value.status == 400 and err.value.field == "multimodal_params.images"
    assert coordinator.acquired == []  # refused before anything was decoded or sent
    assert len(prepare(preparer, "<image>" * 2, items[:2]).images) == 2

    default = MultimodalPreparer(FakePromptProcessor(), FakeCoordinator(), "salt")
    many = [png_item(4, 4, i) for i in range(DEFAULT_MAX_IMAGES_PER_REQUEST + 1)]
    with pytest.raises(BadRequest, match="--max_images_per_request"):
        prepare(default, "<image>" * len(many), many)
    assert len(prepare(default, "<image>" * (len(many) - 1), many[1:]).images) == DEFAULT_MAX_IMAGES_PER_REQUEST


def test_images_named_in_the_prompt_count_before_any_is_read():
    processor = FakeQwenVLPromptProcessor()
    policy = ImagePolicy(max_images=2)
    preparer = MultimodalPreparer(processor, FakeCoordinator(), "salt", policy, images_in_prompt=True)
    with pytest.raises(BadRequest, match="--max_images_per_request"):
        prepare(preparer, "<image>" * 3, [])
    assert processor.read == 0


def test_pixels_per_image_cap_is_a_400_naming_the_flag():
    coordinator = FakeCoordinator()
    preparer = MultimodalPreparer(FakePromptProcessor(), coordinator, "salt", ImagePolicy(max_pixels=10_000))
    with pytest.raises(
        BadRequest, match=r"image is 200x100 = 20000 pixels, more than the limit of 10000 \(--max_image_pixels\)"
    ) as err:
        prepare(preparer, "<image><image>", [png_item(100, 100), png_item(200, 100)])
    assert err.value.status == 400 and err.value.field == "multimodal_params.images[1]"
    with pytest.raises(BadRequest, match="--max_image_pixels"):
        prepare(preparer, "<image>", [b64(bomb_png(100_000, 100_000))])
    assert coordinator.acquired == []
    assert len(prepare(preparer, "<image>", [png_item(100, 100)]).images) == 1


def test_cli_flags_and_defaults():
    config = parse_config([])
    assert (config.max_image_pixels, config.max_images_per_request) == (1 << 25, 16)
    config = parse_config(["--max_image_pixels", "1000", "--max_images_per_request", "3"])
    assert (config.max_image_pixels, config.max_images_per_request) == (1000, 3)
    for flag in ("--max_image_pixels", "--max_images_per_request"):
        with pytest.raises(SystemExit):
            parse_config([flag, "0"])
