"""Shipped recipes against the model and the platforms; the memory estimate; the generated docs (drift check).

- every packaged recipe loads, forms a valid mesh for the released model and
  (for the released model) fits its device by the estimate;
- `omni-run recipes --platform X` checks what it can and names the reason
  when X is not present here;
- every vendor recipe passes its platform's recipe check and resolves its
  kernels on the recording doubles of tests/doubles (what `omni-run recipes
  --platform X` does on the real machine), CUDA ones on made-up `Caps`;
- the estimator, by hand, on the released parameter counts
  (../shared/hunyuan_image3.md section 2);
- docs/recipes/ is what `omni-run recipes --docs` writes (regenerate on failure).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from omni import memory_estimate, platform_manager, recipe_docs
from omni.cli import main
from omni.parallel.mesh import Degrees, expert_layout
from omni.recipe import BUILTIN_PLATFORMS, GiB, list_recipes, load_recipe

TESTS = Path(__file__).resolve().parent
for extra in (TESTS, TESTS / "contract"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

RELEASED = [n for n in list_recipes() if load_recipe(n).model.flavor == "hunyuan_image3"]
B = 1e9


@pytest.fixture(scope="module")
def cfg():
    return memory_estimate.released_config()


# ------------------------------------------------------------------ shipped recipes


@pytest.mark.parametrize("name", list_recipes())
def test_every_shipped_recipe_loads_with_an_empty_or_complete_validated_block(name):
    recipe = load_recipe(name)
    assert recipe.platform in BUILTIN_PLATFORMS, "a shipped recipe names its platform (no auto)"
    assert recipe.device.count == recipe.parallel.world_size
    for entry in recipe.validated:
        assert {"date", "hardware", "commit"} <= set(entry)


@pytest.mark.parametrize("name", RELEASED)
def test_shipped_layout_splits_the_released_model(name, cfg):
    recipe = load_recipe(name)
    d = Degrees.from_recipe(recipe.parallel)  # raises MeshError for impossible degrees
    assert cfg.num_key_value_heads % d.tp == 0, "tp splits whole KV groups"
    assert memory_estimate.kv_heads_per_rank(cfg, d) >= 1
    for rank in range(d.world_size):
        assert len(expert_layout(d, rank).expert_range(cfg.num_experts)) >= 1
    if d.world_size > 1:
        # a recipe enables capture only where a measurement shows it gains; none exists on several devices yet
        assert recipe.graph.mode == "eager", "multi-rank capture is not measured on any shipped layout"


@pytest.mark.parametrize("name", RELEASED)
def test_shipped_recipe_fits_its_device_by_the_estimate(name):
    recipe = load_recipe(name)
    est = memory_estimate.estimate(recipe)
    assert recipe.device.memory_gib > 0, "a released-model recipe states its device memory"
    assert est.verdict == "fits", f"{name}: {est.total_bytes / GiB:.1f} GiB of {recipe.device.memory_gib} GiB"


# ------------------------------------------------------------------ omni-run recipes --platform X


def _absent(name: str) -> str | None:
    det = platform_manager.detect(name, platform_manager.discover((name,))[name])
    return None if det.info is not None else "; ".join(det.reasons)


@pytest.mark.parametrize("platform", ["rocm", "npu", "xpu", "musa", "cuda"])
def test_recipes_for_an_absent_platform_are_listed_with_the_reason(platform, capsys):
    reason = _absent(platform)
    if reason is None:
        pytest.skip(f"{platform} is present here: its recipes are checked for real")
    assert main(["recipes", "--platform", platform]) == 0, "an absent platform is a note, not a failure"
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith("note:")}
    mine = [n for n in list_recipes() if load_recipe(n).platform == platform]
    assert mine, f"no shipped recipe for {platform}"
    for name in mine:
        assert f"ok (schema); not checked: platform {platform} not present here ({reason})" in rows[name]
    for name in set(list_recipes()) - set(mine):
        assert "skipped (platform" in rows[name]
    assert f"note: platform {platform} is not present here ({reason})" in out


def test_recipes_check_one_file_for_an_absent_platform_names_the_reason(capsys):
    reason = _absent("npu")
    if reason is None:
        pytest.skip("npu is present here")
    assert main(["recipes", "--check", "a2_tp4", "--platform", "npu"]) == 0
    assert f"ok: a2_tp4 (not checked: platform npu not present here ({reason}))" in capsys.readouterr().out


def test_a_broken_recipe_still_fails_the_listing(tmp_path, monkeypatch, capsys):
    """Schema validation runs for every file, whatever --platform says."""
    import shutil

    from omni import cli

    folder = tmp_path / "recipes"
    folder.mkdir()
    shutil.copy(Path(recipe_docs.__file__).parents[1] / "recipes" / "a2_tp4.yaml", folder)
    (folder / "a2_broken.yaml").write_text("platform: npu\ndevice: {kind: a2, count: 3}\n")
    monkeypatch.setattr(cli, "list_recipes", lambda: ["a2_tp4", "a2_broken"])
    monkeypatch.setattr(cli, "load_recipe", lambda n: load_recipe(folder / f"{n}.yaml"))
    assert main(["recipes", "--platform", "npu"]) == 2
    out = capsys.readouterr().out
    assert "a2_broken" in out and "device.count: 3 device(s) but the parallel world size is 1" in out


# ------------------------------------------------------------------ each vendor recipe on its platform's doubles


def _vendor_installers():
    from doubles.aiter import install_rocm
    from doubles.ipex import install_xpu
    from doubles.torch_musa import install_musa
    from doubles.torch_npu import install_npu

    return {"a2": lambda mp: install_npu(mp, soc="Ascend910B2"), "a3": lambda mp: install_npu(mp, soc="Ascend910_93"),
            "a5": lambda mp: install_npu(mp, soc="Ascend950PR"), "mi325x": lambda mp: install_rocm(mp, arch="gfx942"),
            "mi350x": lambda mp: install_rocm(mp, arch="gfx950"), "b70": lambda mp: install_xpu(mp),
            "s5000": lambda mp: install_musa(mp, capability=(3, 1))}


# recipe -> (attention, dense linear, grouped expert GEMM) the platform resolves; "reference-*" entries
# are the documented gaps each recipe's comments state (rocm/xpu/musa have no grouped GEMM yet, ...)
VENDOR_KERNELS = {
    "a2_tp4": ("npu-fia", "npu-quant-matmul[w8a8]", "npu-grouped-matmul[w8a8]"),
    "a2_tp4_distil": ("npu-fia", "npu-quant-matmul[w8a8]", "npu-grouped-matmul[w8a8]"),
    "a3_cfg2_tp4": ("npu-fia", "reference-linear[none]", "npu-grouped-matmul[none]"),
    "a5_sp4": ("npu-fia", "npu-quant-matmul[w8a8]", "npu-grouped-matmul[w8a8]"),
    "mi325x_tp2": ("rocm-aiter", "reference-linear[none]", "reference-grouped[none]"),
    "mi325x_tp2_distil": ("rocm-aiter", "reference-linear[none]", "reference-grouped[none]"),
    "mi325x_sp4": ("rocm-aiter", "reference-linear[none]", "reference-grouped[none]"),
    "mi350x_tp2": ("rocm-aiter", "reference-linear[none]", "reference-grouped[none]"),
    "mi350x_sp4": ("rocm-aiter", "reference-linear[none]", "reference-grouped[none]"),
    "b70_tp4_text": ("xpu-ipex-varlen", "xpu-scaled-mm[fp8_tensor]", "reference-grouped[fp8_tensor]"),
    "s5000_tp2": ("musa-flash", "reference-linear[none]", "reference-grouped[none]"),
    "s5000_tp4": ("musa-flash", "reference-linear[none]", "reference-grouped[none]"),
}


def test_every_vendor_recipe_has_a_kernel_expectation():
    vendor = {n for n in list_recipes() if load_recipe(n).platform in ("rocm", "npu", "xpu", "musa")}
    assert vendor == set(VENDOR_KERNELS)


def _specs(recipe, cfg):
    from omni.specs import AttentionSpec, GemmSpec, GroupedGemmSpec

    d = Degrees.from_recipe(recipe.parallel)
    paged = recipe.kv_cache.mode == "paged"
    heads = cfg.num_attention_heads // d.tp // d.ulysses
    attn = AttentionSpec(num_heads=heads, num_kv_heads=memory_estimate.kv_heads_per_rank(cfg, d),
                         head_dim=cfg.head_dim, dtype=torch.bfloat16, paged=paged,
                         page_size=recipe.kv_cache.page_tokens if paged else 0, backend=recipe.attention.backend)
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim // d.tp
    linear = GemmSpec(in_features=cfg.hidden_size, out_features=qkv, dtype=torch.bfloat16, quant=recipe.quant.scheme)
    layout = expert_layout(d, 0)
    grouped = GroupedGemmSpec(num_experts=cfg.num_experts // layout.groups, in_features=cfg.hidden_size,
                              out_features=2 * max(cfg.moe_intermediate_size) // layout.expert_tp,
                              dtype=torch.bfloat16, quant=recipe.quant.scheme)
    return attn, linear, grouped


@pytest.mark.parametrize("name", sorted(VENDOR_KERNELS))
def test_vendor_recipe_passes_its_platform_check_and_resolves_on_the_doubles(name, cfg, monkeypatch):
    from vendor_cases import PLUGINS

    recipe = load_recipe(name)
    _vendor_installers()[recipe.device.kind](monkeypatch)
    plugin = PLUGINS[recipe.platform]()
    det = platform_manager.detect(recipe.platform, plugin)
    assert det.info is not None, det.reasons
    platform = platform_manager.Platform(det.info, plugin)
    platform.device_services(0)
    assert platform.check_recipe(recipe) == []
    assert det.info.device_count >= recipe.device.count
    attn, linear, grouped = _specs(recipe, cfg)
    got = (platform.attention(attn).name, platform.linear(linear).name, platform.grouped_gemm(grouped).name)
    assert got == VENDOR_KERNELS[name]


CUDA_CAPS = {"h100": (9, 0), "h200": (9, 0), "b200": (10, 0), "rtx5090": (12, 0)}


@pytest.mark.parametrize("name", [n for n in RELEASED if load_recipe(n).platform == "cuda"])
def test_cuda_recipe_gemms_resolve_on_its_device_class(name, cfg):
    """No reference fallback for a CUDA recipe's GEMMs (made-up Caps of the recipe's device class)."""
    from omni.platforms.cuda import gemm
    from omni.platforms.cuda.capabilities import Caps

    recipe = load_recipe(name)
    sm = CUDA_CAPS[recipe.device.kind]
    caps = Caps(sm=sm, cuda_version=(13, 0), has_scaled_mm=True, has_grouped_mm=True, has_scaled_grouped_mm=True)
    assert gemm.block_scaled_refusal(recipe.quant.scheme, sm) is None
    _, linear, grouped = _specs(recipe, cfg)
    reasons: list[str] = []
    assert gemm.resolve_linear(linear, caps, reasons.append) is not None, reasons
    assert gemm.resolve_grouped(grouped, caps, reasons.append) is not None, reasons


# ------------------------------------------------------------------ the estimator on the released config


def test_parameter_counts_from_the_config_match_the_official_counts():
    c = memory_estimate.param_counts()
    assert c.experts / B == pytest.approx(77.31, abs=0.005)
    assert c.attention / B == pytest.approx(1.342, abs=0.0005)
    assert c.shared / B == pytest.approx(1.208, abs=0.0005)
    assert c.wte / B == c.lm_head / B == pytest.approx(0.545, abs=0.0005)
    assert c.backbone / B == pytest.approx(80.96, abs=0.005)
    assert c.image_io / B == pytest.approx(0.227 + 0.060 + 3 * 0.0178, abs=0.001)
    assert c.vae / B == pytest.approx(0.871)  # the decoder: text-to-image builds no encoder


def test_one_h200_cannot_hold_the_bf16_model():
    recipe = load_recipe("h200_fp8").replace_path("quant.scheme", "none")
    est = memory_estimate.estimate(recipe)
    assert est.weight_bytes > 80.96 * B * 2 > 140 * GiB
    assert est.verdict == "does not fit"


def _replicated_bytes(dtype_bytes=2, vae_bytes=4):
    c = memory_estimate.param_counts()
    return (c.wte + c.lm_head + c.image_io + c.norms) * dtype_bytes + c.router * 4 + c.vae * vae_bytes


def test_tp2_bf16_holds_half_the_sharded_model_plus_the_replicated_parts():
    est = memory_estimate.estimate(load_recipe("h200x2_tp2"))
    sharded = (77.31 + 1.342 + 1.208) * B * 2 / 2
    assert est.weight_bytes == pytest.approx(sharded + _replicated_bytes(), rel=2e-4)
    # ~ half + VAE decoder, wte, lm_head, I/O
    assert est.weight_bytes == pytest.approx(80.96 * B * 2 / 2 + 5.35 * B, rel=0.01)
    assert est.verdict == "fits"


def test_fp8_weights_are_one_byte_and_ep_splits_whole_experts():
    one = {p.name: p for p in memory_estimate.estimate(load_recipe("h200_fp8")).parts}
    assert one["routed experts"].device_bytes == pytest.approx(77.31 * B, rel=1e-4)
    assert one["wte"].bytes_per_param == 2, "embeddings are never quantized"
    b200 = {p.name: p for p in memory_estimate.estimate(load_recipe("b200_tp2_ep2_fp8")).parts}
    assert b200["routed experts"].split == 2 and b200["routed experts"].how == "2 groups of whole experts"
    assert b200["routed experts"].device_bytes == pytest.approx(77.31 * B / 2, rel=1e-4)
    assert b200["attention (qkv_proj, o_proj)"].device_bytes == pytest.approx(1.342 * B / 2, rel=1e-3)


def test_layer_offload_keeps_resident_layers_and_prefetch_slots_on_the_device():
    recipe = load_recipe("rtx5090_offload")
    est = memory_estimate.estimate(recipe)
    layer = (77.31 + 1.342 + 1.208) * B * 2 / 32  # bf16 decoder layer without router and norms
    o = recipe.offload
    parts = {p.name: p for p in est.parts}
    on_device = sum(parts[n].device_bytes for n in ("routed experts", "attention (qkv_proj, o_proj)", "shared experts"))
    assert on_device == pytest.approx(layer * (o.resident_layers + o.prefetch_window), rel=1e-3)
    assert est.streamed_bytes == pytest.approx(layer * (32 - o.resident_layers), rel=1e-3)
    bigger = memory_estimate.estimate(recipe.replace_path("offload.resident_layers", o.resident_layers + 2))
    assert bigger.verdict != "fits", "resident_layers is the largest that keeps the reserve"


def test_expert_offload_streams_only_the_experts_and_text_offload_parks_the_embeddings():
    recipe = load_recipe("s5000_tp2")
    parts = {p.name: p for p in memory_estimate.estimate(recipe).parts}
    assert parts["routed experts"].host_bytes == pytest.approx(77.31 * B * 2 / 2 * 10 / 32, rel=1e-4)
    assert parts["attention (qkv_proj, o_proj)"].host_bytes == 0
    assert memory_estimate.estimate(recipe.replace_path("offload.mode", "none")).verdict == "does not fit"
    b70 = {p.name: p for p in memory_estimate.estimate(load_recipe("b70_tp4_text")).parts}
    assert b70["wte"].device_bytes == b70["lm_head"].device_bytes == 0
    assert b70["wte"].host_bytes == pytest.approx(0.545 * B * 2, rel=1e-3)


def test_activation_formula_by_hand(cfg):
    # h200_fp8: one device, T = 32800, 8 routed rows per token, I_loc = 3072
    tokens, act = memory_estimate.activation_bytes(load_recipe("h200_fp8"), cfg)
    assert tokens == 32800
    assert act == 32800 * 2 * (4 * 4096 + 6144 + 8 * (2 * 4096 + 3 * 3072))
    # h100_tp2_fp8_cfgp2: each CFG group sees half the rows; tp2 halves q/k/v and expert columns
    tokens, act = memory_estimate.activation_bytes(load_recipe("h100_tp2_fp8_cfgp2"), cfg)
    assert tokens == 16400
    assert act == 16400 * 2 * (4 * 4096 + 3072 + 8 * (2 * 4096 + 3 * 1536))
    # b200 tp2 x ep2: 32 whole experts per rank, same tokens on both: 4 routed rows per token
    _, act = memory_estimate.activation_bytes(load_recipe("b200_tp2_ep2_fp8"), cfg)
    assert act == 65600 * 2 * (4 * 4096 + 3072 + 4 * (2 * 4096 + 3 * 3072))


def test_kv_bytes_per_token_follow_the_heads_each_rank_stores(cfg):
    per_token = {n: memory_estimate.estimate(load_recipe(n)).kv_token_bytes for n in
                 ("h200_fp8", "h200x2_tp2", "h100_tp4_fp8", "h100_tp2_fp8_sp2", "mi325x_sp4")}
    assert per_token == {"h200_fp8": 128 << 10, "h200x2_tp2": 64 << 10, "h100_tp4_fp8": 32 << 10,
                         "h100_tp2_fp8_sp2": 32 << 10, "mi325x_sp4": 32 << 10}


# ------------------------------------------------------------------ generated docs


def test_docs_are_generated_from_the_recipes(tmp_path):
    """Fails when docs/recipes/ drifts from recipes/: run `omni-run recipes --docs` and commit the result."""
    recipe_docs.write_docs(tmp_path)
    fresh = {p.name: p.read_text() for p in tmp_path.glob("*.md")}
    shipped = {p.name: p.read_text() for p in recipe_docs.REPO_DOCS.glob("*.md")}
    assert set(fresh) == {f"{n}.md" for n in list_recipes()} | {"README.md"}
    stale = sorted(n for n in fresh.keys() | shipped.keys() if fresh.get(n) != shipped.get(n))
    assert not stale, f"docs/recipes is stale ({', '.join(stale)}): run `omni-run recipes --docs`"
    assert recipe_docs.main(["--check"]) == 0


def test_drift_check_notices_an_edit_and_a_leftover(tmp_path):
    recipe_docs.write_docs(tmp_path)
    assert recipe_docs.drift(tmp_path) == []
    (tmp_path / "a2_tp4.md").write_text("hand edited\n")
    (tmp_path / "gone.md").write_text("<!-- generated by omni.recipe_docs from recipes/gone.yaml -->\n")
    assert recipe_docs.drift(tmp_path) == ["a2_tp4.md", "gone.md"]
    recipe_docs.write_docs(tmp_path)
    assert recipe_docs.drift(tmp_path) == [] and not (tmp_path / "gone.md").exists()


def test_generation_is_deterministic(tmp_path):
    assert recipe_docs.expected_files() == recipe_docs.expected_files()


def test_recipe_page_has_command_layout_estimate_and_validation():
    page = recipe_docs.expected_files(["a2_tp4"])["a2_tp4.md"]
    assert "omni-run --platform npu --recipe a2_tp4 --model" in page
    assert "/v1/images/generations" in page
    assert "omni-run generate --platform npu --recipe a2_tp4" in page and "launches 4 ranks" in page, \
        "generate launches a multi-rank recipe's ranks, as serve does"
    assert "**tp=4** (tensor parallel)" in page and "| `model.wte` | replicated:" in page
    assert "quant.scheme: w8a8" in page and "kv_cache: paged, pages of 128 tokens" in page
    assert "**Verdict: fits**" in page and "Not yet validated on hardware" in page
    single = recipe_docs.expected_files(["rtx5090_offload"])["rtx5090_offload.md"]
    assert 'omni-run generate --platform cuda --recipe rtx5090_offload --model /ckpt/HunyuanImage-3 --prompt' in single


def test_validated_entries_are_rendered(tmp_path):
    recipe = load_recipe("h200_fp8")
    text = (Path(recipe_docs.__file__).parents[1] / "recipes" / "h200_fp8.yaml").read_text()
    text = text.replace("validated: []", "validated:\n  - {date: 2026-11-30, hardware: 1x H200, commit: abc1234, "
                                          "images_per_min: 3.1}")
    path = tmp_path / "h200_fp8.yaml"
    path.write_text(text)
    page = recipe_docs.render_recipe(load_recipe(path))
    assert ("| date | hardware | commit | images_per_min |" in page
            and "| 2026-11-30 | 1x H200 | abc1234 | 3.1 |" in page)
    assert recipe.validated == ()


def test_cli_docs_writes_the_pages(tmp_path, capsys):
    assert main(["recipes", "--docs", str(tmp_path)]) == 0
    assert f"pages to {tmp_path}" in capsys.readouterr().out
    assert recipe_docs.drift(tmp_path) == []
