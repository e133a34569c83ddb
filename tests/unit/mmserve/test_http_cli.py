"""The command line: LightLLM's launch lines parse unchanged into a frozen ServerConfig and an EngineConfig."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from mmserve.launch.cli import parse_config

# LightLLM users' launch lines, with our module name
QWEN_VL_LINE = (
    "--host 0.0.0.0 --port 8080 --tp 1 --max_total_token_num 12000 --trust_remote_code "
    "--enable_multimodal --cache_capacity 1000 --model_dir /path/of/Qwen-VL-Chat"
)
LLAMA_LINE = "--model_dir /path/llama-7B --host 0.0.0.0 --port 8080 --tp 1 --mem_fraction 0.9"


def test_lightllm_launch_lines():
    cfg = parse_config(shlex.split(QWEN_VL_LINE))
    assert (cfg.host, cfg.port, cfg.max_total_token_num, cfg.cache_capacity) == ("0.0.0.0", 8080, 12000, 1000)
    assert cfg.trust_remote_code and cfg.enable_multimodal and cfg.model_dir == "/path/of/Qwen-VL-Chat"
    cfg = parse_config(shlex.split(LLAMA_LINE))
    assert cfg.max_total_token_num is None and cfg.mem_fraction == 0.9
    # LightLLM's vision-attention flag, as LightLLM's launch lines pass it (one value per visual dp tower)
    assert parse_config(shlex.split(QWEN_VL_LINE + " --vit_att_backend sdpa")).vit_att_backend == "sdpa"
    assert cfg.graceful_timeout == 30.0 and parse_config(["--graceful_timeout", "2.5"]).graceful_timeout == 2.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1


def test_engine_config_from_server_config():
    cfg = parse_config(
        shlex.split(LLAMA_LINE + " --data_type bf16 --eos_id 2 7 --running_max_req_size 8 --max_req_total_len 2048")
    )
    eng = cfg.engine_config()
    assert eng.model_dir == "/path/llama-7B" and eng.data_type == "bfloat16" and eng.eos_id == (2, 7)
    assert eng.max_total_token_num is None and eng.mem_fraction == 0.9
    assert eng.running_max_req_size == 8 and eng.max_req_total_len == 2048


@pytest.mark.parametrize(
    "flags",
    [
        "--tp 0",
        "--tp 3 --nnodes 2",
        "--nnodes 2 --node_rank 2",
        "--visual_dp 2",
        "--load_format pt",
        "--mem_fraction 0",
        "--max_total_token_num 0",
        "--data_type int4",
        "--port 0",
        "--chat_template /nope",
        "--graceful_timeout -1",
        "--visual_infer_batch_size 0",
        "--visual_batch_max_patches -1",
        "--visual_batch_wait_ms -1",
        "--visual_cuda_graph_max_patches -1",
        "--vit_att_backend flash",
    ],
)
def test_bad_flags_exit_with_a_message(flags, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(shlex.split(flags))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flags.split()[0] in err or flags.split()[-2] in err


def test_lightllm_multi_host_line():
    """LightLLM's two-host launch: node 1 of 2 runs ranks 4..7 of --tp 8 and meets node 0 at nccl_host:nccl_port."""
    cfg = parse_config(shlex.split(
        "--model_dir /m --tp 8 --nnodes 2 --node_rank 1 --nccl_host 10.0.0.1 --nccl_port 29000 --load_format dummy"
    ))  # fmt: skip
    assert list(cfg.local_ranks) == [4, 5, 6, 7]
    eng = cfg.engine_config()
    assert (eng.tp, eng.ranks_per_node, eng.dist_init_method) == (8, 4, "tcp://10.0.0.1:29000")
    assert eng.load_format == "dummy"


def test_visual_flags_reach_the_visual_process(tmp_path):
    """--visual_infer_batch_size (LightLLM's) and --visual_batch_max_patches bound the vision tower's batches;
    --vit_att_backend (LightLLM's) picks its attention kernel; --visual_batch_wait_ms lets a batch wait for images
    still being preprocessed."""
    from mmserve.ipc.endpoints import Endpoints
    from mmserve.prep.visual_link import visual_process_config

    endpoints = Endpoints(str(tmp_path), *(f"ipc://{tmp_path}/{n}" for n in ("r", "d", "h", "v", "vr")))
    default = visual_process_config(parse_config(shlex.split(LLAMA_LINE)), endpoints, "p_")
    assert (default.visual_infer_batch_size, default.visual_batch_max_patches) == (16, 16384)
    assert (default.vit_att_backend, default.visual_batch_wait_ms) == ("auto", 10.0)
    assert default.visual_cuda_graph_max_patches == 4096
    flags = " --visual_infer_batch_size 4 --visual_batch_max_patches 0 --vit_att_backend sdpa --visual_batch_wait_ms 15"
    flags += " --visual_cuda_graph_max_patches 1024"
    cfg = visual_process_config(parse_config(shlex.split(LLAMA_LINE + flags)), endpoints, "p_")
    assert (cfg.visual_infer_batch_size, cfg.visual_batch_max_patches, cfg.jobs_addr) == (4, 0, endpoints.visual)
    assert (cfg.vit_att_backend, cfg.visual_batch_wait_ms) == ("sdpa", 15.0)
    assert cfg.visual_cuda_graph_max_patches == 1024
