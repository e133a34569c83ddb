"""--log_level debug: our DEBUG lines, not the libraries' (PIL logs every PNG chunk it reads at DEBUG)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import io, logging
from PIL import Image
from mmserve.launch.processes import configure_logging
configure_logging("debug", "router")
logging.getLogger("mmserve.router.router").debug("step timing: ours")
buf = io.BytesIO()
Image.new("RGB", (4, 4)).save(buf, format="PNG")
Image.open(io.BytesIO(buf.getvalue())).load()  # PIL's DEBUG chunk lines, if its logger were at DEBUG
"""


def test_debug_logging_keeps_library_loggers_at_info():
    # A child interpreter: basicConfig sets the root logger of the process it runs in.
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    assert "router DEBUG step timing: ours" in out.stderr
    assert "STREAM" not in out.stderr and "PIL" not in out.stderr
