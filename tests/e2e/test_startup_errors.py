"""Start-up as a newcomer meets it: every mistake in the command line (no such model folder, a folder that is not a
model, a model without its tokenizer, a tokenizer that is the checkpoint's own code without --trust_remote_code, an
unknown device, a --generation_config folder without the file or overrides that are no JSON object, a port already
taken) ends the server within seconds, with a non-zero exit and one clear line instead of tracebacks from several
processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from mmserve.testing.server_proc import free_port

_LIMIT_S = 15.0  # the checks run before any child starts: well under it, even on a loaded 2-core CI machine


def run_server(*args: str) -> tuple[int, str, float]:
    """The server's exit status, its whole output and how long it ran."""
    cmd = [sys.executable, "-m", "mmserve.api_server", "--host", "127.0.0.1", *args]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - t0


def assert_one_clear_line(args: tuple[str, ...], expected: str) -> None:
    code, output, took = run_server(*args)
    lines = output.strip().splitlines()
    assert code != 0, output
    assert took < _LIMIT_S, output
    assert "Traceback" not in output and len(lines) < 5, output
    assert expected in output, output
    assert "serving" not in output


@pytest.fixture(scope="module")
def not_a_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("photos")
    (folder / "cat.jpg").write_bytes(b"\xff\xd8 not really")
    return str(folder)


@pytest.fixture(scope="module")
def unknown_architecture(tmp_path_factory, e2e_model_dir) -> str:
    folder = tmp_path_factory.mktemp("bert") / "model"
    shutil.copytree(e2e_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    return str(folder)


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory, e2e_model_dir) -> str:
    folder = tmp_path_factory.mktemp("no_tok") / "model"
    shutil.copytree(e2e_model_dir, folder)
    for name in os.listdir(folder):
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            os.remove(folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def remote_code_tokenizer(tmp_path_factory, e2e_model_dir) -> str:
    """tokenizer_config.json as InternVL2.5-8B's names its tokenizer: a class only its own code defines."""
    folder = tmp_path_factory.mktemp("remote_tok") / "model"
    shutil.copytree(e2e_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    auto_map = {"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer", None]}
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "InternLM2Tokenizer", "auto_map": auto_map})
    )
    return str(folder)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "does not exist"),
        ("not_a_model", "no config.json"),
        ("unknown_architecture", "BertForMaskedLM"),
        ("no_tokenizer", "tokenizer"),
        ("remote_code_tokenizer", "pass --trust_remote_code"),
        ("tpu", "--device"),
        ("not_multimodal", "--enable_multimodal"),
        ("no_generation_config", "--generation_config"),
        ("generation_overrides_not_an_object", "--override_generation_config"),
    ],
)
def test_a_bad_command_line_fails_in_seconds_with_one_line(
    case, expected, e2e_model_dir, not_a_model, unknown_architecture, no_tokenizer, remote_code_tokenizer, tmp_path
):
    model = {
        "missing": str(tmp_path / "no_such_model"),
        "not_a_model": not_a_model,
        "unknown_architecture": unknown_architecture,
        "no_tokenizer": no_tokenizer,
        "remote_code_tokenizer": remote_code_tokenizer,
    }.get(case, e2e_model_dir)
    args = ["--model_dir", model, "--port", str(free_port())]
    if case == "tpu":
        args += ["--device", "tpu"]
    if case == "not_multimodal":
        args += ["--enable_multimodal"]  # a Llama has no vision tower
    if case == "no_generation_config":
        args += ["--generation_config", not_a_model]
    if case == "generation_overrides_not_an_object":
        args += ["--override-generation-config", "[0.5]"]
    assert_one_clear_line(tuple(args), expected)


def test_a_port_in_use_is_found_before_the_model_loads(e2e_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_clear_line(("--model_dir", e2e_model_dir, "--port", str(port), "--device", "cpu"), str(port))
