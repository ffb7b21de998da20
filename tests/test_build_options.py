"""BuildOptions: the recipe read once into what every module is built with, and the kernels.memory_bound choice.

- ``BuildOptions.from_recipe`` maps every field; the object is frozen;
- ``kernels.memory_bound`` is validated by the recipe (and by the specs), errors name the field;
- the reference refuses a ``triton`` demand with a reason; the cuda plugin's memory-bound kernels follow
  the spec (checked on CPU: the selection function and the resolvers against a made-up H100).
"""
from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from omni.build_options import BuildOptions
from omni.platform_manager import PlatformError, select
from omni.platforms.cuda import gemm, moe
from omni.platforms.cuda.capabilities import Caps
from omni.recipe import RecipeError, load_recipe, parse_recipe
from omni.specs import GemmSpec, GroupedGemmSpec, MoESpec

H100 = Caps(sm=(9, 0), cuda_version=(13, 0), has_scaled_mm=True, has_grouped_mm=True, has_scaled_grouped_mm=True)
MOE = MoESpec(num_experts=8, topk=2, hidden=64, inner=32, dtype=torch.bfloat16, quant="fp8_row")
FP8_ROW = GemmSpec(in_features=64, out_features=64, dtype=torch.bfloat16, quant="fp8_row")


# ----------------------------------------------------------------- from the recipe


def test_from_recipe_maps_every_field():
    recipe = load_recipe("cpu_tiny").replace_paths({
        "model.dtype": "bfloat16", "quant.scheme": "fp8_row", "quant.experts_only": True, "kv_cache.mode": "paged",
        "kv_cache.page_tokens": 32, "attention.backend": "sdpa", "graph.mode": "capture",
        "kernels.memory_bound": "torch", "attention.fp8": True, "kernels.fp8_fast_accum": True,
        "kernels.grouped_fp8": "torch", "kernels.shared_expert_stream": True, "kernels.grouped_fp8_small_rows": 0,
        "kernels.fp8_skinny_rows": 0, "kernels.grouped_fp8_skinny_rows": 0, "kernels.pdl_rows": 512})
    opts = BuildOptions.from_recipe(recipe)
    assert opts == BuildOptions(dtype=torch.bfloat16, quant="fp8_row", experts_only=True, paged_kv=True, page_size=32,
                                attn_backend="sdpa", capturable=True, memory_bound="torch", attn_fp8=True,
                                fast_accum=True, grouped_fp8="torch", shared_expert_stream=True, grouped_small_rows=0,
                                skinny_rows=0, grouped_skinny_rows=0, pdl_rows=512)
    # quant.experts_only and kernels.fuse_shared_expert exclude each other (the recipe refuses both): the second
    fused = BuildOptions.from_recipe(recipe.replace_paths({"quant.experts_only": False,
                                                           "kernels.fuse_shared_expert": True}))
    assert fused == dataclasses.replace(opts, experts_only=False, fuse_shared_expert=True)
    defaults = BuildOptions(dtype=torch.float32)
    unchanged = [f.name for f in dataclasses.fields(BuildOptions)
                 if getattr(opts, f.name) == getattr(defaults, f.name) == getattr(fused, f.name)]
    assert not unchanged, f"fields the test does not move off their defaults: {unchanged}"


def test_from_recipe_contiguous_kv_has_no_pages():
    recipe = load_recipe("cpu_tiny").replace_paths({"kv_cache.mode": "contiguous", "kv_cache.page_tokens": 32})
    opts = BuildOptions.from_recipe(recipe)
    assert (opts.paged_kv, opts.page_size, opts.memory_bound, opts.capturable) == (False, 0, "auto", False)


def test_options_are_frozen():
    opts = BuildOptions(dtype=torch.float32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.quant = "fp8_row"


def test_derived_helpers():
    opts = BuildOptions(dtype=torch.bfloat16, quant="fp8_row", experts_only=True, paged_kv=True, page_size=16,
                        attn_backend="sdpa", capturable=True)
    assert opts.dense_quant == "none" and dataclasses.replace(opts, experts_only=False).dense_quant == "fp8_row"
    spec = opts.attention_spec(8, 2, 64, "none")
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.dtype) == (8, 2, 64, torch.bfloat16)
    assert (spec.mask, spec.paged, spec.page_size, spec.backend, spec.capturable) == ("none", True, 16, "sdpa", True)
    assert not opts.attention_spec(8, 2, 64, "causal").capturable  # only the denoising step is captured
    kw = dataclasses.replace(opts, fast_accum=True).linear_kw("none")
    assert kw == dict(dtype=torch.bfloat16, quant="none", memory_bound="auto", fast_accum=True, skinny_rows=64,
                pdl_rows=0)
    assert opts.expert_kw() == dict(dtype=torch.bfloat16, quant="fp8_row", memory_bound="auto", fast_accum=False,
                                    grouped_fp8="auto", small_rows=32, skinny_rows=16, pdl_rows=0)


def test_fast_accum_reaches_every_fp8_kernel_spec():
    """kernels.fp8_fast_accum lands in the spec of every linear, grouped GEMM and MoE the model builds."""
    from omni.layers import GroupedLinear, Linear
    from omni.models.hunyuan_image3.config import HunyuanImage3Config
    from omni.models.hunyuan_image3.tiny import TINY_CONFIG
    from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer
    from omni.platform_manager import select

    cfg = HunyuanImage3Config.from_json_dict(TINY_CONFIG)
    opts = BuildOptions(dtype=torch.float32, quant="fp8_row", fast_accum=True)
    with torch.device("meta"):
        model = HunyuanImage3Transformer(cfg, select("cpu"), opts)
    specs = [m.spec for m in model.modules() if isinstance(m, (Linear, GroupedLinear))]
    fp8 = [s for s in specs if s.quant != "none"]  # every quantized linear and grouped GEMM
    assert len(fp8) >= 4 * cfg.num_hidden_layers and all(s.fast_accum for s in fp8)
    moes = [m.moe_spec for m in model.modules() if hasattr(m, "moe_spec")]
    assert moes and all(s.fast_accum for s in moes)


def test_grouped_fp8_choice_reaches_every_expert_spec():
    """kernels.grouped_fp8 and grouped_fp8_small_rows land in every grouped GEMM and MoE spec the model builds,
    grouped_fp8_skinny_rows in every MoE spec (also after finalize re-derives it), kernels.fp8_skinny_rows in every
    quantized dense linear's (and in TP rebuilds)."""
    from omni.layers import GroupedLinear, Linear
    from omni.models.hunyuan_image3.config import HunyuanImage3Config
    from omni.models.hunyuan_image3.tiny import TINY_CONFIG
    from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer, glue_spec
    from omni.parallel.tp import _rebuild
    from omni.platform_manager import select

    cfg = HunyuanImage3Config.from_json_dict(TINY_CONFIG)
    opts = BuildOptions(dtype=torch.float32, quant="fp8_row", grouped_fp8="torch", grouped_small_rows=5,
                        skinny_rows=7, grouped_skinny_rows=3, pdl_rows=9)
    platform = select("cpu")
    with torch.device("meta"):
        model = HunyuanImage3Transformer(cfg, platform, opts)
    grouped = [m for m in model.modules() if isinstance(m, GroupedLinear)]
    assert len(grouped) == 2 * cfg.num_hidden_layers
    assert all((g.spec.grouped_fp8, g.spec.small_rows) == ("torch", 5) for g in grouped)
    moes = [m.moe_spec for m in model.modules() if hasattr(m, "moe_spec")]
    assert len(moes) == cfg.num_hidden_layers
    assert all((s.grouped_fp8, s.small_rows, s.skinny_rows, s.pdl_rows) == ("torch", 5, 3, 9) for s in moes)
    experts = [m for m in model.modules() if hasattr(m, "moe_spec")]
    assert all(m._spec() == m.moe_spec for m in experts)  # what finalize re-derives after a plan keeps the same
    dense = [m for m in model.modules() if isinstance(m, Linear) and m.spec.quant == "fp8_row"]
    assert len(dense) >= 4 * cfg.num_hidden_layers and all((m.spec.skinny_rows, m.spec.pdl_rows) == (7, 9)
                                                           for m in dense)
    assert glue_spec(cfg, 0, opts).pdl_rows == 9
    with torch.device("meta"):
        half = _rebuild(grouped[0], grouped[0].spec.in_features, grouped[0].spec.out_features // 2,
                        grouped[0].spec.num_experts, platform)
        half_dense = _rebuild(dense[0], dense[0].spec.in_features, dense[0].spec.out_features // 2, None, platform)
    assert (half.spec.grouped_fp8, half.spec.small_rows, half_dense.spec.skinny_rows) == ("torch", 5, 7)
    assert half_dense.spec.pdl_rows == 9


# ----------------------------------------------------------------- the recipe field


def test_kernels_section_is_validated():
    assert parse_recipe("name: x\nkernels: {memory_bound: triton}").kernels.memory_bound == "triton"
    with pytest.raises(RecipeError, match=r"kernels\.memory_bound: 'cuda' is not allowed; allowed values: auto, "
                                          r"triton, torch"):
        parse_recipe("name: x\nkernels: {memory_bound: cuda}")
    with pytest.raises(RecipeError, match=r"kernels\.memory: unknown key 'memory'; allowed: memory_bound"):
        parse_recipe("name: x\nkernels: {memory: torch}")
    assert parse_recipe("name: x\nkernels: {grouped_fp8: cutlass}").kernels.grouped_fp8 == "cutlass"
    assert parse_recipe("name: x").kernels.grouped_fp8 == "auto"
    assert parse_recipe("name: x\nkernels: {grouped_fp8: deepgemm}").kernels.grouped_fp8 == "deepgemm"
    with pytest.raises(RecipeError, match=r"kernels\.grouped_fp8: 'triton' is not allowed; allowed values: auto, "
                                          r"torch, cutlass, deepgemm"):
        parse_recipe("name: x\nkernels: {grouped_fp8: triton}")


def test_memory_bound_choices_match_the_platform_contract():
    from omni import recipe, specs

    assert recipe.MEMORY_BOUND == specs.MEMORY_BOUND
    assert recipe.GROUPED_FP8 == specs.GROUPED_FP8
    assert recipe.GROUPED_SMALL_ROWS == specs.GROUPED_SMALL_ROWS
    assert recipe.GROUPED_SKINNY_ROWS == specs.GROUPED_SKINNY_ROWS
    assert recipe.SKINNY_ROWS == specs.SKINNY_ROWS
    assert recipe.PDL_ROWS == specs.PDL_ROWS


@pytest.mark.parametrize("make", [lambda: dataclasses.replace(MOE, memory_bound="fast"),
                                  lambda: dataclasses.replace(FP8_ROW, memory_bound="fast")], ids=["moe", "gemm"])
def test_specs_refuse_an_unknown_choice_naming_the_field(make):
    with pytest.raises(ValueError, match=r"memory_bound \(kernels\.memory_bound\) must be one of"):
        make()


@pytest.mark.parametrize("make", [lambda: dataclasses.replace(MOE, grouped_fp8="triton"),
                                  lambda: GroupedGemmSpec(num_experts=4, in_features=64, out_features=64,
                                                          dtype=torch.bfloat16, grouped_fp8="triton")],
                         ids=["moe", "grouped"])
def test_specs_refuse_an_unknown_grouped_kernel_naming_the_field(make):
    with pytest.raises(ValueError, match=r"grouped_fp8 \(kernels\.grouped_fp8\) must be one of"):
        make()


def test_reference_refuses_a_cutlass_demand_for_quantized_experts_only():
    cpu = select("cpu")
    grouped = GroupedGemmSpec(num_experts=4, in_features=64, out_features=64, dtype=torch.float32,
                              grouped_fp8="cutlass")
    assert cpu.grouped_gemm(grouped).name  # unquantized: the field does not apply
    for spec in (dataclasses.replace(grouped, quant="fp8_row"), dataclasses.replace(MOE, grouped_fp8="cutlass")):
        with pytest.raises(PlatformError, match="kernels.grouped_fp8=cutlass cannot be met"):
            cpu.grouped_gemm(spec) if isinstance(spec, GroupedGemmSpec) else cpu.moe(spec)


# ----------------------------------------------------------------- the reference


@pytest.mark.parametrize("choice", ["auto", "torch"])
def test_reference_ignores_auto_and_torch(choice):
    cpu = select("cpu")
    assert cpu.moe(dataclasses.replace(MOE, memory_bound=choice)).name.startswith("reference-moe")
    assert cpu.linear(dataclasses.replace(FP8_ROW, memory_bound=choice)).name.startswith("reference-linear")


def test_reference_refuses_a_triton_demand_with_a_reason():
    cpu = select("cpu")
    for resolve, spec in ((cpu.moe, MOE), (cpu.linear, FP8_ROW)):
        with pytest.raises(PlatformError, match=r"reference: kernels\.memory_bound=triton cannot be met"):
            resolve(dataclasses.replace(spec, memory_bound="triton"))


def test_a_model_built_with_a_triton_demand_on_the_reference_fails_at_build():
    from omni.models.hunyuan_image3.config import TINY_GOLDEN
    from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer

    with torch.device("meta"), pytest.raises(PlatformError, match=r"kernels\.memory_bound=triton"):
        HunyuanImage3Transformer(TINY_GOLDEN, select("cpu"), BuildOptions(dtype=torch.float32, memory_bound="triton"))


# ----------------------------------------------------------------- the cuda plugin (on CPU)


@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setattr(moe, "triton_found", lambda: False)


@pytest.fixture
def fake_triton(monkeypatch):
    """Triton "installed": a stand-in for ``moe_triton`` (the real one needs triton and a GPU)."""
    fake = types.ModuleType("omni.platforms.cuda.moe_triton")
    fake.TritonKernels = type("TritonKernels", (), {"name": "triton", "quant_rows": None,
                                                    "__init__": lambda self, pdl: setattr(self, "pdl", pdl)})
    monkeypatch.setitem(sys.modules, "omni.platforms.cuda.moe_triton", fake)
    monkeypatch.setattr(moe, "triton_found", lambda: True)


@pytest.mark.parametrize("choice,found,expected", [
    ("auto", True, "triton"), ("auto", False, "torch"), ("torch", True, "torch"), ("torch", False, "torch"),
    ("triton", True, "triton"),
])
def test_cuda_memory_kernels_follow_the_choice(request, choice, found, expected):
    request.getfixturevalue("fake_triton" if found else "no_triton")
    assert moe.memory_kernels(choice, pytest.fail).name == expected


def test_cuda_memory_kernels_launch_with_pdl_up_to_the_spec_rows_on_hopper(fake_triton):
    from omni.platforms.cuda.pdl import OFF, Pdl

    assert moe.memory_kernels("auto", pytest.fail, 512, (9, 0)).pdl == Pdl(512)
    assert moe.memory_kernels("auto", pytest.fail, 512, (8, 9)).pdl == OFF  # no griddepcontrol before sm90
    assert moe.memory_kernels("auto", pytest.fail).pdl == OFF


def test_cuda_refuses_a_triton_demand_without_triton(no_triton):
    reasons: list[str] = []
    assert moe.memory_kernels("triton", reasons.append) is None
    assert len(reasons) == 1 and reasons[0].startswith("cuda: kernels.memory_bound=triton"), reasons


@pytest.mark.parametrize("choice,expected", [("auto", "torch"), ("torch", "torch")])
def test_cuda_resolvers_take_the_spec_choice(no_triton, choice, expected):
    fused = moe.resolve_moe(dataclasses.replace(MOE, memory_bound=choice), H100, pytest.fail)
    linear = gemm.resolve_linear(dataclasses.replace(FP8_ROW, memory_bound=choice), H100, pytest.fail)
    assert fused.kernels.name == expected and fused.name == f"cuda-fused-moe[fp8_row,{expected}]"
    assert linear.kernels.name == expected and linear.name == f"cuda-scaled-mm[fp8_row,{expected}]"


def test_cuda_resolvers_refuse_a_triton_demand_without_triton(no_triton):
    for resolve, spec in ((moe.resolve_moe, MOE), (gemm.resolve_linear, FP8_ROW),
                          (gemm.resolve_linear, dataclasses.replace(FP8_ROW, quant="none"))):
        reasons: list[str] = []
        assert resolve(dataclasses.replace(spec, memory_bound="triton"), H100, reasons.append) is None
        assert any("kernels.memory_bound=triton" in r for r in reasons), reasons


def test_cuda_resolvers_honour_a_triton_demand_with_triton(fake_triton):
    fused = moe.resolve_moe(dataclasses.replace(MOE, memory_bound="triton"), H100, pytest.fail)
    assert fused.name == "cuda-fused-moe[fp8_row,triton]"


@pytest.mark.parametrize("name", ["rocm", "npu", "xpu", "musa"])
def test_vendors_without_triton_kernels_refuse_a_triton_demand(name):
    """Their gemm/moe modules have no Triton path: the shared hooks refuse before resolving (the reference answers
    with its own refusal, so the NoImplementationError lists both reasons)."""
    import importlib

    plugin = importlib.import_module(f"omni.platforms.{name}.plugin").plugin
    for spec in (MOE, FP8_ROW):
        reason = plugin.triton_refusal(dataclasses.replace(spec, memory_bound="triton"))
        assert reason == (f"{name}: kernels.memory_bound=triton, but this platform has no Triton kernels "
                          "(use auto or torch)")
        assert plugin.triton_refusal(dataclasses.replace(spec, memory_bound="auto")) is None
    cuda = importlib.import_module("omni.platforms.cuda.plugin").plugin
    assert cuda.triton_refusal(dataclasses.replace(MOE, memory_bound="triton")) is None  # cuda decides in its modules


def test_a_capturable_moe_spec_is_refused_by_the_reference():
    """Under graph.mode: capture the routed experts run inside the graph; the reference MoE reads expert counts
    on the host, so it refuses at build time (a device platform without a capturable MoE then fails the build
    with every reason, instead of its first captured step)."""
    cpu = select("cpu")
    plain = dataclasses.replace(MOE, quant="none", dtype=torch.float32)
    assert cpu.moe(plain).name.startswith("reference-moe")
    with pytest.raises(PlatformError, match=r"reference: not capturable \(reads expert counts on the host\)"):
        cpu.moe(dataclasses.replace(plain, capturable=True))
    opts = BuildOptions.from_recipe(load_recipe("cpu_tiny").replace_path("graph.mode", "capture"))
    assert opts.capturable
