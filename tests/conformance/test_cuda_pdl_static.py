"""The PDL rule of the cuda platform's Triton kernels, read off their source (no GPU, no Triton needed).

A kernel that takes the ``PDL`` constexpr is launched with programmatic dependent launch at a decode step's sizes
(``platforms/cuda/pdl.py``): it may start while the kernel before it still runs, so it must call
``wait_for_predecessor`` before it reads or writes memory (``pdl_triton``'s rule), here: before any ``tl.load`` /
``tl.store`` / ``tl.atomic_*`` and before any other jitted helper that might. And every launch of such a kernel
must pass the policy's launch keywords (``**pdl.kw(rows)``, or launch through ``pdl_triton.launch``), or it
silently runs without PDL. The GPU test
(tests/gpu/test_gpu_pdl.py) checks the bits; this one checks that no kernel or launch site was left out.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

CUDA = Path(__file__).resolve().parents[2] / "platforms" / "cuda"
MEMORY_OPS = ("load", "store", "atomic_")


def _trees() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text(), filename=str(p)) for p in sorted(CUDA.glob("*.py"))}


def _jitted(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
            and any("jit" in ast.unparse(d) for d in n.decorator_list)}


def _takes_pdl(fn: ast.FunctionDef) -> bool:
    return "PDL" in [a.arg for a in fn.args.args + fn.args.kwonlyargs]


def _callee(call: ast.Call) -> str:
    """``tl.load`` -> "tl.load", ``helper`` -> "helper", ``kernel[grid]`` -> "kernel" (its last name)."""
    func = call.func.value if isinstance(call.func, ast.Subscript) else call.func
    return ast.unparse(func)


TREES = _trees()
JITTED = {name: fn for tree in TREES.values() for name, fn in _jitted(tree).items()}
PDL_KERNELS = sorted(name for name, fn in JITTED.items() if _takes_pdl(fn) and name != "wait_for_predecessor")


def test_the_platform_has_pdl_kernels():
    assert len(PDL_KERNELS) >= 10, PDL_KERNELS  # the glue, MoE and few-row GEMM kernels; the walk found them


@pytest.mark.parametrize("name", PDL_KERNELS)
def test_a_pdl_kernel_waits_before_it_touches_memory(name):
    fn = JITTED[name]
    calls = sorted((c for c in ast.walk(fn) if isinstance(c, ast.Call)), key=lambda c: (c.lineno, c.col_offset))
    waits = [c for c in calls if _callee(c) == "wait_for_predecessor"]
    assert len(waits) == 1, f"{name}: {len(waits)} calls of wait_for_predecessor"
    assert ast.unparse(waits[0].args[0]) == "PDL", f"{name}: the wait must take the kernel's own PDL constexpr"
    touching = [c for c in calls if _callee(c).startswith(tuple(f"tl.{op}" for op in MEMORY_OPS))
                or (_callee(c) in JITTED and _callee(c) != "wait_for_predecessor")]
    early = [f"{_callee(c)} (line {c.lineno})" for c in touching if c.lineno < waits[0].lineno]
    assert not early, f"{name} touches memory before wait_for_predecessor (line {waits[0].lineno}): {early}"


def _launches() -> list[tuple[str, str, ast.Call]]:
    """(file, kernel, call) for every launch of a PDL kernel in the platform's files: ``kernel[grid](...)``, or
    ``launch(kernel, grid, pdl, rows, ...)`` (``pdl_triton.launch``, which passes the policy's keywords)."""
    out = []
    for file, tree in TREES.items():
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript):
                name = _callee(call).rsplit(".", 1)[-1]
            elif isinstance(call, ast.Call) and _callee(call).rsplit(".", 1)[-1] == "launch" and call.args:
                name = ast.unparse(call.args[0]).rsplit(".", 1)[-1]
            else:
                continue
            if name in PDL_KERNELS:
                out.append((file, name, call))
    return out


def test_every_pdl_kernel_is_launched_somewhere():
    launched = {name for _, name, _ in _launches()}
    assert launched == set(PDL_KERNELS), f"never launched: {sorted(set(PDL_KERNELS) - launched)}"


@pytest.mark.parametrize("file,name,call", _launches(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_launch_passes_the_pdl_keywords(file, name, call):
    explicit = {k.arg for k in call.keywords} & {"PDL", "TRIGGER", "launch_pdl"}
    if isinstance(call.func, ast.Subscript):
        starred = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
        passes = any("pdl" in s.lower() for s in starred)
    else:  # launch(kernel, grid, pdl, rows, ...): the policy is its third argument
        starred = [ast.unparse(a) for a in call.args[2:3]]
        passes = len(call.args) >= 4 and "pdl" in starred[0].lower()
    assert passes and not explicit, (
        f"{file}:{call.lineno} launches {name} without the policy's keywords "
        f"(**pdl.kw(rows) or launch(kernel, grid, pdl, rows, ...)); saw {starred}, explicit {sorted(explicit)}")
