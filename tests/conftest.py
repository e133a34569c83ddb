"""Session-wide test setup. Without a GPU, Triton kernels run under its interpreter on CPU tensors; the variable has
to be set before anything imports triton, which is why it lives here, the first file pytest loads."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
