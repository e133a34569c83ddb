"""A child stops on the parent's STOP_SIGNAL even after it compiled a Triton kernel. The LLVM inside Triton's compiler
installs its own handlers for the signals it knows on its first compile, and swallows SIGUSR1, which was once the
stop signal: a router or visual process that had compiled a kernel (every cold Triton cache) ignored its stop and
was killed after the grace. The compile here is a real one, for sm_90 (no GPU needed: it ends at ptxas)."""

from __future__ import annotations

import signal
import time

from mmserve.launch import processes


def _compile_a_kernel() -> None:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    @triton.jit
    def add_one(x, n: tl.constexpr):
        offsets = tl.arange(0, n)
        tl.store(x + offsets, tl.load(x + offsets) + 1)

    source = triton.compiler.ASTSource(fn=add_one, signature={"x": "*fp32", "n": "constexpr"}, constexprs={"n": 16})
    triton.compile(source, target=GPUTarget("cuda", 90, 32))


def _child_that_compiles(default_action: bool, ready) -> None:
    """A child that compiles a kernel, then serves until told to stop; default_action: as a tensor-parallel rank,
    whose STOP_SIGNAL keeps its default action (it ends the process) instead of run_child's handler."""

    def start():
        if default_action:
            signal.signal(processes.STOP_SIGNAL, signal.SIG_DFL)
        _compile_a_kernel()

        def serve(parent_pid: int) -> None:
            while processes.parent_alive(parent_pid):
                time.sleep(0.05)

        return "compiled", serve

    processes.run_child("compiler", "WARNING", ready, start)


def test_a_child_that_compiled_a_triton_kernel_stops_on_the_stop_signal(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cold cache: the compile runs in the child
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the suite's CPU setting): compiled, not interpreted
    child = processes.spawn_child("compiler", _child_that_compiles, False)
    try:
        processes.wait_ready([child], 120)
        assert child.info == "compiled"
        assert any(tmp_path.rglob("*.cubin")), "the child compiled nothing: the test would prove nothing"
    finally:
        processes.stop_children([child], grace_s=10)
    assert child.exitcode == 0, f"the child did not stop on STOP_SIGNAL (exit code {child.exitcode}: killed)"


def test_a_rank_that_compiled_a_triton_kernel_is_ended_by_the_stop_signals_default(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    child = processes.spawn_child("rank", _child_that_compiles, True)
    try:
        processes.wait_ready([child], 120)
    finally:
        processes.stop_children([child], grace_s=10)
    assert child.exitcode == -processes.STOP_SIGNAL, f"exit code {child.exitcode}: not ended by STOP_SIGNAL"


def test_the_stop_signal_is_not_one_llvm_takes_over():
    """LLVM's handlers cover SIGUSR1 (swallowed), SIGHUP, SIGINT, SIGTERM and SIGUSR2 (re-raised), and the fatal
    signals; a real-time signal is none of them, and its default action still ends a process with no handler."""
    assert processes.STOP_SIGNAL not in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, *processes.SHUTDOWN_SIGNALS)
    assert signal.SIGRTMIN <= processes.STOP_SIGNAL <= signal.SIGRTMAX
