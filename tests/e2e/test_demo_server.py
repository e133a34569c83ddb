"""README's first command: the server with no --model_dir builds a demo checkpoint, says it has random weights,
sizes its KV cache by itself, and the example clients work against it unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mmserve.testing.server_proc import ServerProcess, serving

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xdg_cache")
    # MMSERVE_DEMO_DIR emptied: the default location under $XDG_CACHE_HOME is what this test checks.
    srv = ServerProcess(None, str(cache / "server.log"), env={"XDG_CACHE_HOME": str(cache), "MMSERVE_DEMO_DIR": ""})
    with serving(srv):
        yield srv, cache


def run_example(name: str, url: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_demo_checkpoint_is_built_and_announced(demo_server):
    srv, cache = demo_server
    assert "RANDOM weights" in srv.log()
    assert os.path.isfile(os.path.join(cache, "mmserve", "demo", "llama-tiny-v1", "config.json"))
    assert srv.metrics()["mmserve_kv_tokens_total"] > 0  # sized without --max_total_token_num


def test_example_clients(demo_server):
    srv, _ = demo_server
    answer = json.loads(run_example("client_generate.py", srv.url, "--max_new_tokens", "9", "--details"))
    assert answer["count_output_tokens"] <= 9 and len(answer["tokens"]) == answer["count_output_tokens"]
    assert isinstance(answer["generated_text"], list) and answer["finish_reason"] in ("stop", "length")
    streamed = run_example("client_stream.py", srv.url, "--max_new_tokens", "9")
    assert streamed.rstrip().endswith(f"tokens={answer['count_output_tokens']}]")
    assert streamed.startswith(answer["generated_text"][0])
