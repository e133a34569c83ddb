"""README's first command: `--enable_multimodal` with no --model_dir builds a tiny random Qwen2-VL demo (published
layout, with its chat template) into $MMSERVE_DEMO_DIR, says the weights are random and how long start-up took, and
answers image requests on a CPU; a bad image gets a 400 and the server keeps serving. README's image curl and the
image example client run as written."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys

import httpx
import numpy as np
import pytest
from PIL import Image

from mmserve.launch.demo import DEMO_DIR_ENV, MULTIMODAL_DEMO, ensure_demo_checkpoint
from mmserve.testing.checkpoints.qwen2_vl_demo import CHAT_TEMPLATE
from mmserve.testing.server_proc import ServerProcess, serving

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this picture.<|im_end|>\n<|im_start|>assistant\n"  # noqa: E501


def png_b64(width: int, height: int, seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The server as README starts it (no --model_dir, no --max_total_token_num), with the demo cache, $HOME and
    $XDG_CACHE_HOME in temp dirs, so that the test writes nothing into the user's home."""
    tmp = tmp_path_factory.mktemp("mm_demo")
    env = {DEMO_DIR_ENV: str(tmp / "demos"), "HOME": str(tmp / "home"), "XDG_CACHE_HOME": str(tmp / "xdg")}
    srv = ServerProcess(None, str(tmp / "server.log"), "--enable_multimodal", "--log_level", "info", env=env)
    with serving(srv):
        yield srv, tmp


def generate(srv: ServerProcess, image: dict, max_new_tokens: int = 8) -> httpx.Response:
    body = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "return_details": True},
        "multimodal_params": {"images": [image]},
    }
    return httpx.post(srv.url + "/generate", json=body, timeout=120)


def test_demo_is_built_in_the_demo_dir_announced_and_timed(demo, monkeypatch):
    srv, tmp = demo
    log = srv.log()
    assert "RANDOM weights" in log and "Qwen2-VL" in log
    started = re.search(r"serving \S+ on http://127\.0\.0\.1:\d+ \(started in (\d+\.\d) s\)", log)
    assert started and 0 < float(started.group(1)) < 300, log

    path = tmp / "demos" / MULTIMODAL_DEMO.version
    with open(path / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen2VLForConditionalGeneration"]
    with open(path / "tokenizer_config.json") as f:
        assert json.load(f)["chat_template"] == CHAT_TEMPLATE
    for name in ("chat_template.json", "preprocessor_config.json", "tokenizer.json", "model.safetensors"):
        assert (path / name).is_file(), name
    assert not [p for home in ("home", "xdg") for p in (tmp / home).rglob("*mmserve*")]  # rglob: [] if absent

    # Built once: the next start finds it and builds nothing.
    monkeypatch.setenv(DEMO_DIR_ENV, str(tmp / "demos"))
    mtime = os.stat(path / "model.safetensors").st_mtime_ns
    assert ensure_demo_checkpoint(multimodal=True) == str(path)
    assert os.stat(path / "model.safetensors").st_mtime_ns == mtime


def test_image_request_gets_tokens(demo):
    srv, _ = demo
    small = generate(srv, {"type": "base64", "data": png_b64(64, 48, 0)})
    assert small.status_code == 200, small.text
    answer = small.json()
    assert answer["count_output_tokens"] == 8 and len(answer["tokens"]) == 8
    # A larger picture expands <|image_pad|> into more image tokens (dynamic resolution).
    large = generate(srv, {"type": "base64", "data": png_b64(300, 200, 1)})
    assert large.status_code == 200, large.text
    assert large.json()["prompt_tokens"] > answer["prompt_tokens"]
    assert srv.metrics()["mmserve_images_encoded_total"] == 2


def test_bad_image_is_a_400_and_the_server_keeps_serving(demo):
    srv, _ = demo
    for bad in ({"type": "base64", "data": base64.b64encode(b"not a picture").decode()},
                {"type": "base64", "data": "%%% not base64 %%%"}):  # fmt: skip
        r = generate(srv, bad)
        assert r.status_code == 400, r.text
        assert r.json()["field"] == "multimodal_params.images[0]"
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    ok = generate(srv, {"type": "base64", "data": png_b64(50, 70, 2)}, max_new_tokens=3)
    assert ok.status_code == 200 and ok.json()["count_output_tokens"] == 3


@pytest.mark.skipif(shutil.which("curl") is None, reason="README's command uses curl")
def test_readme_image_curl_runs_as_written(demo):
    srv, _ = demo
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    command = next(b for b in blocks if "multimodal_params" in b)
    assert "127.0.0.1:8080" in command
    # README's `python -c` must be this interpreter (the one with Pillow), as after README's `pip install`.
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    out = subprocess.run(["bash", "-c", command.replace("127.0.0.1:8080", f"127.0.0.1:{srv.port}")],
                         capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["count_output_tokens"] >= 1 and answer["prompt_tokens"] > 20, answer


def test_image_example_client(demo):
    srv, _ = demo
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "client_image.py"), "--url", srv.url, "--max_new_tokens", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert 1 <= answer["count_output_tokens"] <= 5 and isinstance(answer["generated_text"], list)
