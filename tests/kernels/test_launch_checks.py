"""The launchers' shared checks (language/kernels/launch_utils.py): they run on every launch, so they are written as
plain loops; this pins what they accept and the messages they fail with."""

from __future__ import annotations

import pytest
import torch

from language.kernels.launch_utils import check_device, check_shape


def test_check_shape_matches_sizes_with_none_as_any():
    t = torch.empty(3, 4, 5)
    check_shape("t", t, (3, 4, 5))
    check_shape("t", t, (None, 4, None))
    check_shape("t", t, (None, None, None))
    for bad in ((3, 4), (3, 4, 5, 1), (3, 5, 5), (None, None, 6)):
        with pytest.raises(AssertionError, match=r"t: shape \(3, 4, 5\) does not match"):
            check_shape("t", t, bad)
    check_shape("empty", torch.empty(0, 2), (0, None))


def test_check_device_returns_the_shared_device():
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only under TRITON_INTERPRET=1 (conftest)
    a, b = torch.empty(2, device=device), torch.empty(3, device=device)
    assert check_device(a=a, b=b) == a.device
    with pytest.raises(AssertionError, match="tensors on different devices: {'a': device"):
        check_device(a=a, b=torch.empty(2, device="meta"))
