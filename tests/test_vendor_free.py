"""core/ and models/ stay vendor-free: no vendor imports, no platform imports, no vendor branches;
and core/ imports no model package (models register through the ``omni.models`` entry points).

Vendor code lives in platforms/<name>/ behind the hooks of core/hookspecs.py.
The check reads the source with ``ast`` (docstrings and comments may mention
anything) and resolves aliases and relative imports, so ``import torch as t;
t.cuda`` and ``from ..platforms import cuda`` are caught as well. Generic
device code such as ``getattr(torch, device_type)`` is fine.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = {"core": "omni", "models": "omni.models"}  # folder -> import package it maps to

VENDOR_MODULES = ("torch_npu", "intel_extension_for_pytorch", "torch_musa", "aiter", "flash_attn",
                  "flash_attn_interface", "fa3_fwd_interface", "flashinfer")
PLATFORM_PACKAGE = "omni.platforms"
MODEL_PACKAGE = "omni.models"
VENDOR_ATTRIBUTES = ("torch.cuda", "torch.npu", "torch.xpu", "torch.musa", "torch.version.hip", "torch.version.cuda")
VENDOR_PREDICATES = ("is_rocm", "is_npu", "is_xpu", "is_musa", "is_cuda", "is_hip")
VENDOR_DEVICE_STRINGS = ("cuda", "hip", "rocm", "npu", "xpu", "musa")


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


class _Checker(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.in_core = not _under(module, (MODEL_PACKAGE, PLATFORM_PACKAGE))
        self.aliases: dict[str, str] = {}  # local name -> dotted module/attribute it stands for
        self.problems: list[tuple[int, str]] = []

    def flag(self, node: ast.AST, message: str) -> None:
        self.problems.append((node.lineno, message))

    def check_module(self, node: ast.AST, name: str) -> None:
        if _under(name, VENDOR_MODULES):
            self.flag(node, f"imports vendor module {name} (belongs in platforms/<name>/)")
        elif _under(name, (PLATFORM_PACKAGE,)):
            self.flag(node, f"imports platform package {name} (use the hooks through omni.platform_manager)")
        elif _under(name, VENDOR_ATTRIBUTES):
            self.flag(node, f"imports {name} (a vendor branch; ask the platform contract)")
        elif self.in_core and _under(name, (MODEL_PACKAGE,)):
            self.flag(node, f"imports model package {name} (core reaches models through omni.model_registry)")

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.check_module(node, a.name)
            self.aliases[a.asname or a.name.partition(".")[0]] = a.name if a.asname else a.name.partition(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self.resolve(node)
        self.check_module(node, base)
        for a in node.names:
            full = f"{base}.{a.name}"
            self.check_module(node, full)
            self.aliases[a.asname or a.name] = full

    def resolve(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = self.package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1])
        return ".".join(p for p in (base, node.module) if p)

    def dotted(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            head = self.dotted(node.value)
            return f"{head}.{node.attr}" if head else None
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = self.dotted(node)
        if name and name in VENDOR_ATTRIBUTES:
            self.flag(node, f"uses {name} (a vendor branch; ask the platform contract)")
        else:
            self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if _under(self.aliases.get(node.id, ""), VENDOR_ATTRIBUTES):
            self.flag(node, f"uses {self.aliases[node.id]} through the name {node.id}")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        const = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
        first = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
        if name in VENDOR_PREDICATES:
            self.flag(node, f"calls {name}() (a vendor branch)")
        elif name == "getattr" and isinstance(const, str) and self.dotted(node.args[0]) == "torch" \
                and f"torch.{const}" in VENDOR_ATTRIBUTES:
            self.flag(node, f"uses getattr(torch, {const!r}) (a vendor branch)")
        elif name in ("import_module", "__import__") and isinstance(first, str):
            self.check_module(node, first)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if node.name in VENDOR_PREDICATES:
            self.flag(node, f"defines {node.name}() (a vendor branch)")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        for side in [node.left, *node.comparators]:
            if isinstance(side, ast.Constant) and side.value in VENDOR_DEVICE_STRINGS:
                self.flag(node, f"compares against the vendor device string {side.value!r} (a vendor branch)")
        self.generic_visit(node)


def check_source(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """Problems in ``source`` of import ``module`` as (line, message)."""
    checker = _Checker(module, is_package)
    checker.visit(ast.parse(source))
    return checker.problems


def _module_name(path: Path) -> tuple[str, bool]:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    is_package = rest[-1] == "__init__"
    parts = [CHECKED[folder], *(rest[:-1] if is_package else rest)]
    return ".".join(parts), is_package


def _checked_files() -> list[Path]:
    return sorted(p for folder in CHECKED for p in (ROOT / folder).rglob("*.py"))


def test_core_and_models_are_vendor_free():
    problems = []
    for path in _checked_files():
        module, is_package = _module_name(path)
        for line, message in check_source(path.read_text(encoding="utf-8"), module, is_package):
            problems.append(f"{path.relative_to(ROOT)}:{line}: {message}")
    assert not problems, "vendor code in core/ or models/:\n" + "\n".join(problems)


def test_core_imports_no_model_package():
    """Every file of core/, lazy imports inside functions included: models are entry points, never imports."""
    problems = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        module, is_package = _module_name(path)
        problems += [f"{path.relative_to(ROOT)}:{line}: {message}"
                     for line, message in check_source(path.read_text(encoding="utf-8"), module, is_package)
                     if "model package" in message]
    assert not problems, "core/ imports a model:\n" + "\n".join(problems)


def test_common_platform_code_is_vendor_free():
    """platforms/common/ serves every device: torch and omni only, no vendor module, attribute or branch."""
    problems = []
    for path in sorted((ROOT / "platforms" / "common").glob("*.py")):
        is_package = path.stem == "__init__"
        module = "omni.platforms.common" + ("" if is_package else f".{path.stem}")
        for line, message in check_source(path.read_text(encoding="utf-8"), module, is_package):
            if "platform package omni.platforms.common" not in message:  # its own modules may import each other
                problems.append(f"{path.relative_to(ROOT)}:{line}: {message}")
    assert not problems, "vendor code in platforms/common/:\n" + "\n".join(problems)


def test_the_walk_sees_the_tree():
    files = {str(p.relative_to(ROOT)) for p in _checked_files()}
    assert {"core/platform_manager.py", "core/recipe.py", "core/cli.py"} <= files


# ------------------------------------------------------------------ the checker itself


@pytest.mark.parametrize("source, expected", [
    ("import torch_npu", "vendor module torch_npu"),
    ("import flash_attn.flash_attn_interface as fa", "vendor module flash_attn.flash_attn_interface"),
    ("from flashinfer.decode import x", "vendor module flashinfer.decode"),
    ("from aiter import flash_attn_func", "vendor module aiter"),
    ("import intel_extension_for_pytorch as ipex", "vendor module intel_extension_for_pytorch"),
    ("from fa3_fwd_interface import f", "vendor module fa3_fwd_interface"),
    ("import importlib\nimportlib.import_module('torch_musa')", "vendor module torch_musa"),
    ("import omni.platforms.cuda.plugin", "platform package omni.platforms.cuda.plugin"),
    ("from omni.platforms import cuda", "platform package omni.platforms"),
    ("from .platforms.npu import plugin", "platform package omni.platforms.npu"),
    ("import torch\nif torch.version.hip: pass", "torch.version.hip"),
    ("import torch\ntorch.cuda.synchronize()", "torch.cuda"),
    ("import torch as t\nt.npu.current_stream()", "torch.npu"),
    ("from torch import xpu", "torch.xpu"),
    ("import torch\nx = getattr(torch, 'musa')", "getattr(torch, 'musa')"),
    ("if current_platform.is_rocm(): pass", "is_rocm()"),
    ("if is_cuda(): pass", "is_cuda()"),
    ("def is_npu(): return True", "defines is_npu()"),
    ("if x.device.type == 'cuda': pass", "'cuda'"),
    ("from omni.models.hunyuan_image3.build import build_pipeline", "model package omni.models.hunyuan_image3"),
    ("def f():\n    from .models.hunyuan_image3 import resolution", "model package omni.models.hunyuan_image3"),
    ("import importlib\nimportlib.import_module('omni.models.hunyuan_image3')", "model package omni.models"),
])
def test_checker_flags_offending_source(source, expected):
    problems = check_source(source, "omni.layers")
    assert problems and any(expected in message for _, message in problems), problems


def test_checker_resolves_relative_imports_from_models():
    src = "from ...platforms.cuda import attention"
    assert check_source(src, "omni.models.hunyuan_image3.transformer")
    assert check_source("from ...platforms import npu", "omni.models.hunyuan_image3", is_package=True)
    assert not check_source("from ..platforms import npu", "omni.models.hunyuan_image3", is_package=True)
    assert not check_source("from ...specs import AttentionSpec", "omni.models.hunyuan_image3.transformer")


def test_models_may_import_their_own_package():
    assert not check_source("from .pipeline import HunyuanImage3Pipeline", "omni.models.hunyuan_image3.build")
    assert not check_source("from omni.models.hunyuan_image3 import resolution", "omni.models.hunyuan_image3.flavors")


def test_checker_accepts_generic_device_code():
    src = '''
"""Docstrings may say torch.cuda, torch_npu and is_rocm() freely."""
import torch
import torch.nn.functional as F
from ..specs import AttentionSpec  # torch.version.hip in a comment is fine
mod = getattr(torch, device_type)
stream = torch.Stream(device=device)
if device.type == "cpu":
    pass
y = F.scaled_dot_product_attention(q, k, v)
'''
    assert check_source(src, "omni.device") == []
