"""The preprocessing pool's stop leaves no semaphore behind: the visual process exits by os._exit (exit_now), which
skips the finalizers that unlink the pool queues' POSIX semaphores, and multiprocessing's resource tracker then
warned "There appear to be 5 leaked semaphore objects to clean up at shutdown" at every server stop."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, sys
    from visual.preprocess import PreprocessPool

    class Model:  # what the pool reads of a vision model: a picklable preprocessor factory
        @staticmethod
        def preprocessor():
            return None

    if __name__ == "__main__":
        pool = PreprocessPool(Model(), num_workers=2)
        pool._executor.submit(int).result()  # the workers are up
        pool.shutdown()
        sys.stderr.flush()
        os._exit(0)  # as the visual process leaves (mmserve.processes.exit_now)
    """
)


def test_the_pool_stop_leaves_no_leaked_semaphores(tmp_path):
    script = tmp_path / "pool_stop.py"
    script.write_text(SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    # communicate() reads stderr to its end: the resource tracker, which inherits it, has exited by then
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr, done.stderr
