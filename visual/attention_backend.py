"""Which kernel the vision towers' attention runs: LightLLM's `--vit_att_backend`, set once per visual process before
its tower is built (as LightLLM's `set_vit_att_backend`). No torch here: the server's CLI reads the names."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# LightLLM v1.2.0's choices. auto and triton: ours (visual/kernels/varlen_attention.py) where it applies, torch's
# flash elsewhere; sdpa: torch's flash / SDPA only. fa3 and xformers are not bundled here: they mean auto.
VIT_ATT_BACKENDS = ("auto", "triton", "sdpa", "fa3", "xformers")
_NOT_BUNDLED = ("fa3", "xformers")

_backend = "auto"


def set_vit_att_backend(name: str) -> None:
    global _backend
    if name not in VIT_ATT_BACKENDS:
        raise ValueError(f"--vit_att_backend must be one of {', '.join(VIT_ATT_BACKENDS)}, got {name!r}")
    if name in _NOT_BUNDLED:
        logger.warning("--vit_att_backend %s is not bundled with mmserve: using auto (our Triton kernel)", name)
        name = "auto"
    _backend = name


def vit_att_backend() -> str:
    """auto, triton or sdpa."""
    return _backend


def our_kernel_allowed() -> bool:
    """Whether the towers may send a batch to our Triton kernel (where it applies)."""
    return _backend != "sdpa"
