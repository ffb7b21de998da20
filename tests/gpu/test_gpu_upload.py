"""``omni.device.upload`` queues a host-to-device copy without waiting for the device (CUDA).

A decode step is prepared while the last one still runs (text_steps'
lookahead); a copy that waits for the stream to drain (what a plain
``torch.tensor(data, device="cuda")`` does) would serialize the two again.
Checked without timing: a long sleep kernel is queued, then the copy; the
sleep must still be running when the copy call returns. The plain copy,
for contrast, returns only after it.
"""
from __future__ import annotations

import pytest
import torch

from omni.device import upload

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

SLEEP_CYCLES = 2_000_000_000  # about a second at the H200's clock


def busy_device() -> torch.cuda.Event:
    """Queue a long sleep; the event passes when it has run."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    done = torch.cuda.Event()
    done.record()
    return done


def test_upload_does_not_wait_for_queued_kernels():
    done = busy_device()
    t = upload([[3, 4], [5, 6]], "cuda", torch.long)
    still_running = not done.query()
    torch.cuda.synchronize()
    assert still_running, "upload waited for the kernels queued before it"
    assert t.device.type == "cuda" and t.tolist() == [[3, 4], [5, 6]] and t.dtype == torch.long


def test_a_plain_copy_from_pageable_memory_waits():
    done = busy_device()
    torch.tensor([1, 2, 3], device="cuda")
    assert done.query(), "a blocking copy returns after the queued kernels (why upload exists)"
