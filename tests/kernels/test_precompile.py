"""compile_only: launches inside it compile and run nothing; afterwards the same launches run, already compiled."""

import pytest
import torch
import triton
import triton.language as tl

from language.kernels import precompile

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not precompile.available(), reason="compiles for a GPU (no interpreter)"
)


@triton.jit
def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):  # this test's own kernel: compiled nowhere else
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def _compiled() -> int:
    return sum(len(caches[0]) for caches in _add_one_kernel.device_caches.values())


def test_launches_inside_compile_only_run_nothing_and_are_compiled_after():
    x = torch.zeros(100, device="cuda")
    with precompile.compile_only("test"):
        for block in (32, 64):
            _add_one_kernel[(triton.cdiv(100, block),)](x, 100, BLOCK=block)
    torch.cuda.synchronize()
    assert (x == 0).all(), "a launch inside compile_only ran"
    assert _compiled() == 2
    _add_one_kernel[(4,)](x, 100, BLOCK=32)
    _add_one_kernel[(2,)](x, 100, BLOCK=64)
    assert _compiled() == 2, "the real launches compiled again"
    assert (x == 2).all()
