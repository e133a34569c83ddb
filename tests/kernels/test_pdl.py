"""Programmatic dependent launch (language/kernels/launch_utils.py): the switch's decision, that every kernel of a
decode step takes USE_PDL and its launch passes the decision, and that the kernels compiled for sm_90 wait for the
previous kernel before they read activations (the GEMVs after requesting their first weight tile, the norms their
weight). The compiled checks build PTX for sm_90 with Triton's own ptxas, in a subprocess without the interpreter: no
GPU needed."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from language.kernels import launch_utils
from language.kernels.launch_utils import PDL_OFF, PDL_ON, pdl_launch, pdl_supported, set_pdl, use_pdl

ROOT = Path(__file__).resolve().parents[2]
# The modules whose kernels run in a decode step (embed_splice and prefill attention only in prompts).
DECODE_KERNEL_MODULES = [
    "rms_norm", "gemma_norm", "head_rms_norm", "rotary", "kv_store", "rotary_store", "decode_attention", "silu_mul",
    "gemv", "fp8_gemv", "fp8_quant", "skinny_gemm", "fp8_gemm", "greedy_sample",
]  # fmt: skip


@pytest.fixture
def pdl_switch():
    yield set_pdl
    set_pdl(True)  # the process default


def test_off_on_cpu_and_under_the_interpreter(monkeypatch, pdl_switch) -> None:
    pdl_switch(True)
    assert not use_pdl(torch.device("cpu")) and pdl_launch(torch.device("cpu")) is PDL_OFF
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # decided before any CUDA call: no device needed
    assert not pdl_supported(torch.device("cuda"))


def test_the_switch_turns_it_off_everywhere(pdl_switch) -> None:
    pdl_switch(False)
    assert not use_pdl(torch.device("cuda")) and pdl_launch(torch.device("cuda")) is PDL_OFF


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_by_default_on_hopper_and_later(pdl_switch) -> None:
    device = torch.device("cuda")
    hopper = torch.cuda.get_device_capability(device) >= (9, 0) and not launch_utils.interpreting()
    pdl_switch(True)
    assert use_pdl(device) == hopper and (pdl_launch(device) is PDL_ON) == hopper
    pdl_switch(False)
    assert not use_pdl(device)


def _jit_kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """The module's Triton kernels: jit functions whose names end in _kernel (the launched ones)."""
    return {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and node.decorator_list
    }


def _launches(tree: ast.Module, kernels: set[str]) -> list[ast.Call]:
    """Every `kernel[grid](...)` call of one of `kernels`."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Subscript)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in kernels
    ]


@pytest.mark.parametrize("module", DECODE_KERNEL_MODULES)
def test_every_decode_kernel_takes_use_pdl_and_its_launch_passes_the_decision(module: str) -> None:
    tree = ast.parse((ROOT / "language" / "kernels" / f"{module}.py").read_text())
    kernels = _jit_kernels(tree)
    assert kernels, f"{module}: no kernel found"
    for name, fn in kernels.items():
        assert "USE_PDL" in [a.arg for a in fn.args.args], f"{module}.{name}: no USE_PDL"
    launches = _launches(tree, set(kernels))
    assert {call.func.value.id for call in launches} == set(kernels), f"{module}: a kernel launched nowhere"
    for call in launches:
        spread = [kw.value for kw in call.keywords if kw.arg is None]
        assert any(
            isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "pdl_launch" for v in spread
        ), f"{module}: {call.func.value.id} launched without **pdl_launch(device)"


# Compiled for sm_90 in a subprocess (the interpreter, on in this session without a GPU, has no PTX): each kernel's
# loads (by width) and griddepcontrol instructions in program order. Without alignment hints every load is one
# element: the activations and the weights are given different widths, so the PTX says which a load reads.
_COMPILE = r"""
import importlib, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
# (language.kernels.gemv, the attribute, is the launcher: the package re-exports it)
fp8_gemv, gemv, rms_norm, rotary_store = (
    importlib.import_module(f"language.kernels.{m}") for m in ("fp8_gemv", "gemv", "rms_norm", "rotary_store")
)

def trace(fn, constexprs, pointer_types, num_warps=4):
    signature = {p.name: "constexpr" if p.is_constexpr else pointer_types.get(p.name, "i32") for p in fn.params}
    signature.update({name: "fp32" for name in ("eps",) if name in signature})
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    found = re.findall(r"ld\.global\S*\.(b\d+)|griddepcontrol\.(\w+)", compiled.asm["ptx"])
    return [width or control for width, control in found]

use_pdl = sys.argv[1] == "1"
x32 = {"x_ptr": "*fp32", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16"}  # x: b32, weights: b16
fp8 = {"x_ptr": "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*bf16",
       "out_ptr": "*bf16"}  # x: b16, weights: b8
rows = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*fp32", "out_ptr": "*bf16",
        "sum_ptr": "*bf16"}  # activations: b16, the norm's weight: b32
qkv_int8 = {**{f"{t}_ptr": "*bf16" for t in ("q", "k", "v", "q_out")}, "cos_ptr": "*fp32", "sin_ptr": "*fp32",
            "k_cache_ptr": "*i8", "v_cache_ptr": "*i8", "slots_ptr": "*i64", "k_scale_ptr": "*fp32",
            "v_scale_ptr": "*fp32"}
print(json.dumps({
    "gemv": trace(gemv._gemv_kernel, dict(HAS_BIAS=False, EVEN_K=True, BLOCK_N=4, BLOCK_K=512, USE_PDL=use_pdl),
                  x32),
    "fp8_gemv_fused": trace(fp8_gemv._fp8_gemv_kernel, dict(
        QUANTIZE_X=True, PER_CHANNEL=True, HAS_BIAS=False, EVEN_K=True, GROUP=512, BLOCK_N=16, BLOCK_K=512,
        AMAX_BLOCK=4096, FP8_MAX=448.0, MIN_SCALE=1e-12 / 448.0, ROUND_FP8=False, USE_PDL=use_pdl), fp8),
    "add_rms_norm": trace(rms_norm._add_rms_norm_kernel, dict(BLOCK_H=4096, ROUND_FP8=False, USE_PDL=use_pdl), rows,
                          num_warps=8),
    "rotary_store_kv": trace(rotary_store._rotary_store_kv_kernel, dict(
        HALF=64, BLOCK_QH=16, BLOCK_KVH=4, BLOCK_D=128, KV_QUANT=1, ROUND_FP8=False, USE_PDL=use_pdl), qkv_int8),
}))
"""
WEIGHT_WIDTH = {"gemv": "b16", "fp8_gemv_fused": "b8", "add_rms_norm": "b32"}
X_WIDTH = {"gemv": "b32", "fp8_gemv_fused": "b16", "add_rms_norm": "b16"}


def _compiled(use_pdl: bool) -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE, "1" if use_pdl else "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _split_at_wait(trace: list[str]) -> tuple[list[str], list[str]]:
    """The loads before the one wait, and those after; the next kernel is released right after the wait."""
    assert trace.count("wait") == 1, trace
    at = trace.index("wait")
    assert trace[at + 1] == "launch_dependents", trace
    return trace[:at], trace[at + 2 :]


@pytest.fixture(scope="module")
def compiled_with_pdl() -> dict[str, list[str]]:
    return _compiled(True)


@pytest.mark.parametrize("name", ["gemv", "fp8_gemv_fused", "add_rms_norm"])
def test_weights_are_requested_before_the_wait_and_activations_after(compiled_with_pdl, name: str) -> None:
    before, after = _split_at_wait(compiled_with_pdl[name])
    assert before and set(before) == {WEIGHT_WIDTH[name]}, f"{name}: before the wait {before}"
    assert X_WIDTH[name] in after, f"{name}: no activation load after the wait"


@pytest.mark.parametrize("name", ["rotary_store_kv"])
def test_other_kernels_wait_before_any_load(compiled_with_pdl, name: str) -> None:
    before, after = _split_at_wait(compiled_with_pdl[name])
    assert before == [] and after


def test_without_pdl_no_griddepcontrol_is_compiled() -> None:
    for name, trace in _compiled(False).items():
        assert "wait" not in trace and "launch_dependents" not in trace, name
