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


@pytest.fixture(scope="session")
def platform():
    """The cuda platform with device 0's services (files needing more, such as a built kernel, override it)."""
    from omni import platform_manager

    p = platform_manager.select("cuda")
    p.device_services(0)
    return p
