"""Fixtures of the GPU tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def no_tf32():
    """fp32 means fp32 here: cuDNN convolutions (the VAE encoder) and matmuls may default to TF32."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before
