"""Where the GPU tests run: CUDA, or Triton's interpreter on the CPU for the
kernel tests that can (TRITON_INTERPRET=1, small shapes)."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
needs_kernels = pytest.mark.skipif(not (HAS_CUDA or INTERPRET),
                                   reason="needs CUDA (or TRITON_INTERPRET=1)")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
