"""A full /dev/shm (a container's 64 MB default, filled) must be an error the server can report, not a crash: the
segments are allocated when created, so the writer gets OSError(ENOSPC) instead of a SIGBUS on its first write to a
page the tmpfs cannot supply. Run for real in a private mount namespace whose /dev/shm is a 1 MiB tmpfs (the host's
/dev/shm is not touched)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# root may mount in a new mount namespace; anyone else needs a user namespace too (where the kernel allows them)
UNSHARE = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--user", "--map-root-user"])
SMALL_SHM = "mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "


def in_small_shm(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    command = SMALL_SHM + f"{sys.executable} -c {_quote(code)}"
    return subprocess.run([*UNSHARE, "sh", "-c", command], capture_output=True, text=True, timeout=120, env=env)


def _quote(code: str) -> str:
    return "'" + textwrap.dedent(code).replace("'", "'\\''") + "'"


def _can_mount_a_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run([*UNSHARE, "sh", "-c", SMALL_SHM + "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    not _can_mount_a_tmpfs(), reason="needs a private mount namespace (root, or unprivileged user namespaces)"
)


def test_pixels_that_do_not_fit_raise_enospc_and_leave_no_segment():
    done = in_small_shm(
        """
        import errno, os, torch
        from visual.shared_pixels import share_tensor, take_tensor
        try:
            share_tensor(torch.zeros(1 << 20), "mmsv_test_")  # 4 MiB into 1 MiB
        except OSError as e:
            assert e.errno == errno.ENOSPC and "no room in /dev/shm" in str(e), e
        else:
            raise AssertionError("no error")
        assert [n for n in os.listdir("/dev/shm") if n.startswith("mmsv_test_")] == []
        small = torch.arange(1000.0)
        assert torch.equal(take_tensor(share_tensor(small, "mmsv_test_")), small)  # what fits still works
        print("ok")
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_embeddings_that_do_not_fit_raise_enospc_and_leave_no_segment():
    done = in_small_shm(
        """
        import errno, os, torch
        from visual.shm_segments import read_embedding, write_embedding
        try:
            write_embedding("mmsv_test_", "big", torch.zeros(1024, 1024))  # 4 MiB into 1 MiB
        except OSError as e:
            assert e.errno == errno.ENOSPC and "no room in /dev/shm" in str(e), e
        else:
            raise AssertionError("no error")
        assert [n for n in os.listdir("/dev/shm") if n.startswith("mmsv_test_")] == []
        small = torch.randn(16, 32)
        write_embedding("mmsv_test_", "small", small)
        assert torch.equal(read_embedding("mmsv_test_", "small"), small)
        print("ok")
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_spare_segments_never_take_the_room_of_a_small_shm():
    """A 1 MiB /dev/shm has no room for 8 spares' worth: none is made, and writes go on the old way."""
    done = in_small_shm(
        """
        import os, time, torch
        from visual.shm_segments import read_embedding
        from visual.spare_segments import SpareSegments
        segments = SpareSegments("mmsv_test_", count=2)
        small = torch.randn(16, 32)
        segments.expect([small])
        segments.write("a", small)
        time.sleep(0.5)  # the refill thread had its chance
        assert [n for n in os.listdir("/dev/shm") if "spare" in n] == [] and segments.taken == 0
        assert torch.equal(read_embedding("mmsv_test_", "a"), small)
        segments.close()
        print("ok")
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])
