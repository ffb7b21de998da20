"""``omni.group_norm``: its parallel form against ``F.group_norm`` (shapes, affine or not, a large mean), the
CPU path, autocast."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni.group_norm import GroupNorm, group_norm, parallel_group_norm

CASES = [((1, 64, 9, 11), 32), ((2, 128, 3, 8, 8), 32), ((3, 32, 5), 8), ((1, 8, 2, 1), 8)]


@pytest.mark.parametrize("shape,groups", CASES, ids=[str(s) for s, _ in CASES])
@pytest.mark.parametrize("affine", [True, False])
def test_matches_torch_group_norm(shape, groups, affine):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 3 + 0.5
    w = torch.randn(shape[1], generator=g) if affine else None
    b = torch.randn(shape[1], generator=g) if affine else None
    torch.testing.assert_close(parallel_group_norm(x, groups, w, b, 1e-6), F.group_norm(x, groups, w, b, 1e-6),
                               atol=1e-5, rtol=1e-5)  # a few fp32 roundings apart (the golden tests allow 1e-5)


def test_float64_is_exact_to_its_roundings_and_a_large_mean_keeps_precision():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 64, 16, 16, generator=g, dtype=torch.float64) + 100.0  # |mean| / std = 100
    w, b = torch.randn(64, generator=g, dtype=torch.float64), torch.randn(64, generator=g, dtype=torch.float64)
    torch.testing.assert_close(parallel_group_norm(x, 32, w, b, 1e-6), F.group_norm(x, 32, w, b, 1e-6), atol=1e-11,
                               rtol=0)
    xf = x.float()
    err = (parallel_group_norm(xf, 32, w.float(), b.float(), 1e-6).double()
           - F.group_norm(x, 32, w, b, 1e-6)).abs().max()
    assert float(err) < 2e-4  # fp32 holds 100 + x to ~1e-5; the normalised values keep that


def test_module_keeps_the_state_dict_and_autocast_keeps_torch_group_norm():
    m = GroupNorm(num_groups=4, num_channels=16, eps=1e-5)
    ref = torch.nn.GroupNorm(4, 16, eps=1e-5)
    assert list(m.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    x = torch.randn(2, 16, 6, 6)
    torch.testing.assert_close(m(x), ref(x), atol=2e-6, rtol=2e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = m(x.bfloat16()), ref(x.bfloat16())
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)


def test_the_cpu_keeps_torch_group_norm_bit_for_bit():
    x, w, b = torch.randn(2, 64, 7, 7), torch.randn(64), torch.randn(64)
    assert torch.equal(group_norm(x, 32, w, b, 1e-6), F.group_norm(x, 32, w, b, 1e-6))
