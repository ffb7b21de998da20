"""``bench/kernel_resources.py``'s readers of ptxas's report and of a SASS listing, on text those tools printed for
sm_90 binaries (the tool itself needs Triton and runs in ``tests/conformance/test_cuda_sm90_compile_cpu.py``)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "bench" / "kernel_resources.py"
spec = importlib.util.spec_from_file_location("kernel_resources", TOOL)
kr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kr)

# cuobjdump -sass of two toy kernels compiled for sm_90 with PDL: one loads before its wait, one after
SASS_LOAD_BEFORE_WAIT = """
        /*0060*/                   IMAD.WIDE.U32 R2, R7, 0x2, R2 ;
        /*0070*/                   LDG.E.U16 R3, desc[UR4][R2.64] ;
        /*0080*/                   IMAD.WIDE.U32 R4, R7, 0x2, R4 ;
        /*0090*/                   ACQBULK ;
        /*00a0*/                   STG.E.U16 desc[UR4][R4.64], R3 ;
        /*00b0*/                   EXIT ;
"""
SASS_WAIT_FIRST = """
        /*0030*/                   ULDC.64 UR4, c[0x0][0x208] ;
        /*0040*/                   ACQBULK ;
        /*0050*/                   LDC.64 R4, c[0x0][0x218] ;
        /*0080*/                   LDG.E.U16 R3, desc[UR4][R2.64] ;
        /*00a0*/                   STG.E.U16 desc[UR4][R4.64], R3 ;
"""
# ptxas -v for the shipped Winograd input transform (spills) and a toy kernel (none)
PTXAS_SPILLS = """ptxas info    : Compiling entry function 'input_kernel' for 'sm_90a'
ptxas info    : Function properties for input_kernel
    192 bytes stack frame, 192 bytes spill stores, 192 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 192 bytes cumulative stack size
"""
PTXAS_CLEAN = """ptxas info    : Function properties for bad
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
"""


def test_a_load_before_the_pdl_wait_is_counted_and_one_after_it_is_not():
    assert kr.memory_before_wait(SASS_LOAD_BEFORE_WAIT) == 1
    assert kr.memory_before_wait(SASS_WAIT_FIRST) == 0


def test_without_a_wait_every_global_access_counts():
    assert kr.memory_before_wait(SASS_WAIT_FIRST.replace("ACQBULK", "NOP")) == 2


def test_ptxas_report_gives_registers_and_spills():
    assert kr.parse_ptxas(PTXAS_SPILLS) == {"regs": 255, "stack": 192, "spill_stores": 192, "spill_loads": 192}
    assert kr.parse_ptxas(PTXAS_CLEAN) == {"regs": 10, "stack": 0, "spill_stores": 0, "spill_loads": 0}


def test_a_report_without_registers_is_an_error():
    with pytest.raises(ValueError, match="no register report"):
        kr.parse_ptxas("ptxas fatal   : Unresolved extern function 'foo'")
