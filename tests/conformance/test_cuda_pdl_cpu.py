"""The cuda platform's PDL policy (``platforms/cuda/pdl.py``), which needs no GPU: which calls launch with
programmatic dependent launch. The launches themselves: tests/gpu/test_gpu_pdl.py."""
from __future__ import annotations

from omni.platforms.cuda.pdl import OFF, TRIGGER_ROWS, Pdl


def test_calls_up_to_the_row_limit_launch_with_pdl():
    pdl = Pdl.on_device(512, (9, 0))
    assert pdl.kw(1) == pdl.kw(TRIGGER_ROWS - 1) == {"PDL": True, "launch_pdl": True, "TRIGGER": False}
    assert pdl.kw(TRIGGER_ROWS) == pdl.kw(512) == {"PDL": True, "launch_pdl": True, "TRIGGER": True}
    off = {"PDL": False, "TRIGGER": False}  # and no launch_pdl key, which a Triton older than the option may refuse
    assert pdl.kw(513) == pdl.kw(0) == off  # past the limit; 0 rows: no launch at all


def test_devices_before_hopper_and_a_zero_limit_never_launch_with_it():
    assert Pdl.on_device(512, (8, 9)) == Pdl.on_device(0, (9, 0)) == OFF
    assert OFF.kw(1) == {"PDL": False, "TRIGGER": False}
    assert Pdl.on_device(512, (10, 0)).max_rows == 512


def test_the_classes_are_every_keyword_set_a_call_can_get():
    """``pdl_triton.launch`` compiles a kernel's binary for each of them at its first launch."""
    pdl = Pdl.on_device(512, (9, 0))
    assert [dict(k) for k in pdl.classes()] == [pdl.kw(1), pdl.kw(TRIGGER_ROWS), pdl.kw(513)]
    assert {id(pdl.kw(rows)) for rows in range(0, 2000)} == {id(k) for k in pdl.classes()}
    assert [dict(k) for k in OFF.classes()] == [OFF.kw(1)]
    small = Pdl.on_device(TRIGGER_ROWS - 1, (9, 0))  # the early launch never reached
    assert [dict(k) for k in small.classes()] == [small.kw(1), small.kw(TRIGGER_ROWS)]
