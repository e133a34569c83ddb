"""Every option from one source: each flag is one config field, its default and help written once, on the field;
--help is grouped and shows each default."""

from __future__ import annotations

import ast
import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path

from mmserve.launch.cli import GROUPS, build_parser, flag_names, option_fields, parse_config
from mmserve.launch.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mmserve", "language", "visual", "cache")

# Every flag the command line took before the options moved onto the config fields (LightLLM's names): they all
# still work.
FLAGS_BEFORE = """
--model_dir --host --port --tp --nnodes --node_rank --nccl_host --nccl_port --visual_dp --load_format
--max_total_token_num --mem_fraction --running_max_req_size --max_req_total_len --chunked_prefill_size
--disable_chunked_prefill --disable_dynamic_prompt_cache --graph_max_batch_size --disable_cudagraph
--piecewise_cuda_graph_max_tokens --eos_id --trust_remote_code --enable_multimodal --cache_capacity --data_type
--device --allow_private_urls --tower_turn_ms --visual_infer_batch_size --visual_batch_max_patches
--visual_batch_wait_ms --vit_att_backend --image_dir --max_image_pixels --max_images_per_request --vision_tower_dir
--served_model_name --chat_template --log_level --tokenizer_workers --graceful_timeout --request_read_timeout
--stream_write_timeout --visual_max_restarts
""".split()


def _flag_actions():
    return [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]


def test_each_flag_is_one_field_with_the_fields_default():
    actions = _flag_actions()
    fields = {f.name: f for f in option_fields()}
    assert sorted(a.dest for a in actions) == sorted(fields), "a flag without a field, or a field without a flag"
    parser = build_parser()
    for action in actions:
        assert action.option_strings == flag_names(fields[action.dest])
        assert parser.get_default(action.dest) == fields[action.dest].default, action.dest
    assert set(FLAGS_BEFORE) <= {s for a in actions for s in a.option_strings}
    # no flag given: the config is the dataclass's own defaults
    assert parse_config([]) == ServerConfig()


def _defaults_restated(defaults: dict[str, object]) -> list[str]:
    """Where code in the packages writes an option's default again under the option's name: as a class field's or a
    function parameter's default, or as a constant passed by keyword (None and False, "not given" and "off", are
    everyone's)."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name, value in _defaulted_names(ast.parse(path.read_text(), str(path))):
                if name in defaults and isinstance(value, ast.Constant) and value.value not in (None, False):
                    if value.value == defaults[name]:
                        found.append(f"{path.relative_to(ROOT)}:{value.lineno} {name} = {value.value!r}")
    return found


def _defaulted_names(tree: ast.AST):
    """(name, default) of every class field, function parameter and call keyword with one."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                    yield item.target.id, item.value
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = args.posonlyargs + args.args
            yield from zip(
                (a.arg for a in positional[len(positional) - len(args.defaults) :]), args.defaults, strict=True
            )
            yield from ((a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None)
        elif isinstance(node, ast.Call):
            yield from ((k.arg, k.value) for k in node.keywords if k.arg)


def test_each_default_is_written_once():
    defaults = {f.name: f.default for f in option_fields()}
    assert _defaults_restated(defaults) == []
    names = set(defaults)
    # and each option field is defined in one class only (the engine's, the visual process's or the server's)
    owners = {}
    for cls in ServerConfig.__mro__:
        for name in getattr(cls, "__annotations__", {}):
            if name in names:
                owners.setdefault(name, []).append(cls.__name__)
    assert {name: classes for name, classes in owners.items() if len(classes) > 1} == {}


def test_help_is_grouped_and_shows_each_default():
    """`mmserve --help`, as a user runs it: the groups in order, and each flag's default (a flag whose default is
    'not given' says what omitting it means)."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "mmserve.api_server", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    headings = [line[:-1] for line in out.stdout.splitlines() if line and not line[0].isspace() and line[-1] == ":"]
    assert headings == ["options", *GROUPS]
    entries = _help_entries(out.stdout)
    assert entries["--port"] == ("serving", "--port N HTTP port (default: 8000)")
    for f in option_fields():
        group, entry = entries[flag_names(f)[0]]
        assert group == f.metadata["group"], f.name
        if f.default is None:
            assert "omitted:" in entry, entry
        elif not isinstance(f.default, bool):  # a switch is off unless given
            assert entry.endswith(f"(default: {f.default})"), entry


def _help_entries(text: str) -> dict[str, tuple[str, str]]:
    """--help's entries by their first flag: (the group it is under, the entry on one line)."""
    entries, group, flag = {}, None, None
    for line in text.splitlines():
        if line and not line[0].isspace():
            group = line.rstrip(":")
        elif line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = (group, " ".join(line.split()))
        elif line.strip() and flag:
            entries[flag] = (group, f"{entries[flag][1]} {' '.join(line.split())}")
    return entries


def test_vllm_spellings_are_aliases():
    cfg = parse_config(shlex.split(
        "--tensor-parallel-size 2 --max-model-len 512 --dtype bf16 --max-num-seqs 8 --enforce-eager "
        "--trust-remote-code --load-format dummy --served-model-name m"
    ))  # fmt: skip
    assert (cfg.tp, cfg.max_req_total_len, cfg.data_type, cfg.running_max_req_size) == (2, 512, "bfloat16", 8)
    assert not cfg.cuda_graph and cfg.trust_remote_code and cfg.load_format == "dummy"
    assert cfg.served_model_name == "m"


def test_kv_cache_types_by_lightllm_and_vllm_names():
    """--llm_kv_type (LightLLM's) and --kv_cache_dtype (vLLM's) set one field, in one spelling from there on."""
    spellings = {"": "None", "--llm_kv_type None": "None", "--kv_cache_dtype auto": "None",
                 "--llm_kv_type int8kv": "int8kv", "--kv_cache_dtype int8": "int8kv",
                 "--llm_kv_type fp8kv": "fp8kv", "--llm_kv_type fp8kv_sph": "fp8kv", "--kv-cache-dtype fp8": "fp8kv",
                 "--kv_cache_dtype fp8_e4m3": "fp8kv"}  # fmt: skip
    for flags, kv_type in spellings.items():
        assert parse_config(shlex.split("--model_dir /m " + flags)).engine_config().llm_kv_type == kv_type, flags
    result = subprocess.run([sys.executable, "-m", "mmserve.api_server", "--llm_kv_type", "int4kv"],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert result.returncode == 2 and "--llm_kv_type" in result.stderr


def test_the_engine_reads_the_names_the_command_line_sets():
    """One name end to end: the engine's config has the flag's field, with the flag's value."""
    cfg = parse_config(shlex.split(
        "--model_dir /m --graph_max_batch_size 64 --piecewise_cuda_graph_max_tokens 0 --chunked_prefill_size 128 "
        "--disable_dynamic_prompt_cache --max_total_token_num 999"
    ))  # fmt: skip
    eng = cfg.engine_config()
    assert (eng.graph_max_batch_size, eng.piecewise_cuda_graph_max_tokens, eng.chunked_prefill_size) == (64, 0, 128)
    assert (eng.prefix_cache, eng.max_total_token_num) == (False, 999)
    from language.options import EngineOptions

    for f in dataclasses.fields(EngineOptions):
        assert getattr(eng, f.name) == getattr(cfg, f.name)


def test_disable_pdl_turns_programmatic_dependent_launch_off():
    assert parse_config(["--model_dir", "/m"]).pdl
    assert not parse_config(["--model_dir", "/m", "--disable_pdl"]).pdl
