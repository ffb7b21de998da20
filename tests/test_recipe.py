"""Recipe schema, loader, errors, overrides and plan patches (fast, CPU, no torch needed)."""
import ast
import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from omni.recipe import (
    FrozenDict,
    Recipe,
    RecipeError,
    apply_patches,
    field_paths,
    list_recipes,
    load_recipe,
    parse_bytes,
    parse_recipe,
    parse_requirement,
    parse_size,
    schema_rows,
    unmet_requirement,
)

ROOT = Path(__file__).resolve().parents[1]

# The recipe surface, frozen: a change here is a deliberate change of every user's
# recipe files (add it to docs and the changelog, keep old keys working if possible).
RECIPE_FIELD_PATHS = [
    "name", "description", "platform", "requires",
    "device.kind", "device.count", "device.memory_gib", "device.memory_limit_gib",
    "device.expandable_segments",
    "model.flavor", "model.path", "model.dtype", "model.vae_dtype",
    "parallel.tp", "parallel.ep", "parallel.ulysses", "parallel.ring", "parallel.cfg", "parallel.dp",
    "quant.scheme", "quant.experts_only",
    "attention.backend", "attention.fp8",
    "kernels.memory_bound", "kernels.fp8_fast_accum", "kernels.grouped_fp8", "kernels.grouped_fp8_small_rows",
    "kernels.grouped_fp8_skinny_rows", "kernels.fp8_skinny_rows", "kernels.pdl_rows", "kernels.shared_expert_stream",
    "kernels.fuse_shared_expert",
    "kv_cache.mode", "kv_cache.budget_bytes", "kv_cache.page_tokens",
    "offload.mode", "offload.resident_layers", "offload.prefetch_window",
    "step_cache.enabled", "step_cache.threshold",
    "graph.mode",
    "vae.tiling", "vae.tile_latents", "vae.overlap", "vae.streams",
    "serving.host", "serving.port", "serving.max_queue", "serving.max_running", "serving.max_batch_tokens",
    "serving.text_tokens_per_image_step", "serving.request_timeout_s", "serving.warmup_steps", "serving.compile_first",
    "serving.api_key_env",
    "serving.max_image_pixels", "serving.png_compress_level",
    "serving.fetch_remote_images",
    "ray.min_replicas", "ray.max_replicas", "ray.target_ongoing_requests", "ray.ingress_replicas", "ray.retries",
    "defaults.steps", "defaults.guidance", "defaults.size", "defaults.shift", "defaults.template",
    "defaults.system_prompt",
    "validated",
]


def write(tmp_path: Path, text: str, name: str = "x_test.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert "\n" not in message, "recipe errors are one line"
    assert message.startswith(str(path) + ": "), "recipe errors name the file first"
    return message


# ------------------------------------------------------------------ packaged recipes


def test_packaged_recipes_are_listed():
    assert {"cpu_tiny", "h200_fp8"} <= set(list_recipes())


@pytest.mark.parametrize("name", list_recipes())
def test_every_packaged_recipe_loads_and_follows_the_conventions(name):
    recipe = load_recipe(name)
    assert recipe.name == name
    assert recipe.description, "shown by omni-run recipes"
    assert recipe.requires and unmet_requirement(recipe.requires) is None
    device = name.split("_")[0]  # <device>_<layout>.yaml, device = kind or kind x count
    assert device in (recipe.device.kind, f"{recipe.device.kind}x{recipe.device.count}")
    assert recipe.device.count == recipe.parallel.world_size
    assert isinstance(recipe.validated, tuple)


def test_packaged_recipe_loads_by_path_too():
    by_path = load_recipe(ROOT / "recipes" / "cpu_tiny.yaml")
    assert by_path == load_recipe("cpu_tiny")


def test_cpu_tiny_is_the_embedded_default():
    r = load_recipe("cpu_tiny")
    assert (r.platform, r.model.flavor, r.model.path, r.model.dtype) == ("cpu", "hunyuan_image3_tiny", None, "float32")
    assert (r.defaults.steps, r.defaults.guidance, r.defaults.size) == (20, 5.0, "128x128")
    assert r.defaults.width_height == (128, 128)
    assert (r.kv_cache.mode, r.graph.mode) == ("paged", "eager")
    assert r.kv_cache.budget_bytes < 1 << 30


def test_h200_fp8():
    r = load_recipe("h200_fp8")
    assert (r.platform, r.device.kind, r.device.count) == ("cuda", "h200", 1)
    assert (r.model.flavor, r.model.dtype, r.quant.scheme) == ("hunyuan_image3", "bfloat16", "fp8_row")
    assert r.kv_cache.budget_bytes == 16 << 30
    assert (r.graph.mode, r.defaults.steps, r.defaults.guidance) == ("capture", 50, 5.0)
    assert r.device.memory_gib <= 140.4, "an H200 reports 143771 MiB = 140.4 GiB"


def test_unknown_packaged_name_lists_the_packaged_recipes():
    with pytest.raises(RecipeError, match="unknown recipe 'nope'; packaged recipes: .*cpu_tiny"):
        load_recipe("nope")


def test_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="cannot read"):
        load_recipe(tmp_path / "absent.yaml")


# ------------------------------------------------------------------ errors name file, key, allowed values


def test_unknown_top_level_key(tmp_path):
    message = error_of(tmp_path, "platform: cpu\nparalel: {tp: 1}\n")
    assert "paralel: unknown key 'paralel'" in message
    assert "allowed: name, description, platform, requires, device, model, parallel" in message


def test_unknown_nested_key(tmp_path):
    message = error_of(tmp_path, "parallel: {tp: 1, tpp: 2}\n")
    assert "parallel.tpp: unknown key 'tpp'; allowed: tp, ep, ulysses, ring, cfg, dp" in message


def test_bad_enum_value_names_allowed_values(tmp_path):
    message = error_of(tmp_path, "attention: {backend: fa4}\n")
    assert "attention.backend: 'fa4' is not allowed; allowed values: auto, sdpa, varlen, fa3, flex, fia, aiter" \
        in message
    assert "allowed values: auto, cpu, cuda, rocm, npu, xpu, musa" in error_of(tmp_path, "platform: tpu\n")
    assert "allowed values: none, fp8_tensor, fp8_row" in error_of(tmp_path, "quant: {scheme: fp4}\n")


@pytest.mark.parametrize("text, expected", [
    ("parallel: {tp: four}\n", "parallel.tp: expected an integer, got str 'four'"),
    ("parallel: {tp: 2.0}\n", "parallel.tp: expected an integer, got float 2.0"),
    ("parallel: {tp: true}\n", "parallel.tp: expected an integer, got bool True"),
    ("graph: capture\n", "graph: expected a mapping with keys mode, got str 'capture'"),
    ("vae: {tiling: 1}\n", "vae.tiling: expected true or false, got int 1"),
    ("defaults: {size: 1024}\n", "defaults.size: expected a string, got int 1024"),
    ("defaults: {guidance: lots}\n", "defaults.guidance: expected a number, got str 'lots'"),
    ("model: {path: 3}\n", "model.path: expected a string or null, got int 3"),
    ("- platform: cpu\n", "expected a mapping with keys name, description"),
])
def test_type_errors(tmp_path, text, expected):
    assert expected in error_of(tmp_path, text)


@pytest.mark.parametrize("text, expected", [
    ("parallel: {tp: 0}\n", "parallel.tp: must be >= 1, got 0"),
    ("parallel: {cfg: 3}\n", "parallel.cfg: 3 is not allowed; allowed values: 1, 2"),
    ("parallel: {tp: 2}\n", "device.count: 1 device(s) but the parallel world size is 2"),
    ("parallel: {tp: 2, ep: 4}\ndevice: {count: 2}\n", "parallel.ep: must divide the world size 2"),
    ("parallel: {tp: 4, ep: 3}\ndevice: {count: 4}\n", "parallel.ep: must divide the world size 4"),
    ("serving: {port: 70000}\n", "serving.port: must be in 1..65535, got 70000"),
    ("serving: {png_compress_level: 10}\n", "serving.png_compress_level: must be in 0..9, got 10"),
    ("serving: {api_key_env: 'my key'}\n", "serving.api_key_env: must be an environment variable name"),
    ("serving: {compile_first: true, warmup_steps: 0}\n",
     "serving.compile_first: true runs the warm-up's requests in a compile pass first, but serving.warmup_steps "
     "is 0"),
    ("vae: {tile_latents: 8, overlap: 8}\n", "vae.overlap: must be < tile_latents (8), got 8"),
    ("vae: {streams: 2}\n", "vae.streams: vae.streams=2 decodes tiles concurrently, but vae.tiling is false"),
    ("vae: {tiling: true, streams: 0}\n", "vae.streams: must be >= 1, got 0"),
    ("device: {memory_gib: 40, memory_limit_gib: 48}\n", "device.memory_limit_gib: must be <= device.memory_gib (40)"),
    ("quant: {experts_only: true}\n", "quant.experts_only: true needs a quant.scheme other than none"),
    ("defaults: {size: 1024x0}\n", "defaults.size: must be WIDTHxHEIGHT"),
    ("kv_cache: {budget_bytes: 2 gigs}\n", "kv_cache.budget_bytes: expected bytes as an integer or a string"),
    ("kv_cache: {budget_bytes: 0}\n", "kv_cache.budget_bytes: must be > 0, got 0"),
    ("requires: omni-run>>0.1\n", "requires: must be a requirement like 'omni-run>=0.1'"),
    ("name: My Recipe\n", "name: must be lowercase letters"),
    ("platform: cpu\nplatform: cuda\n", "invalid YAML at line 2, column 1: duplicate key 'platform'"),
    ("parallel: {tp: [1,\n", "invalid YAML at line 2"),
    ("", "empty recipe"),
    ("validated:\n  - {date: 2025-10-02, hardware: 1x H200}\n", "validated: entry 0: missing commit"),
    ("validated: {date: 2025-10-02}\n", "validated: expected a list of result entries"),
])
def test_bad_values(tmp_path, text, expected):
    assert expected in error_of(tmp_path, text)


def test_minimal_recipe_takes_defaults_and_the_file_stem_as_name(tmp_path):
    r = load_recipe(write(tmp_path, "platform: cpu\nparallel:\nvalidated:\n", name="cpu_min.yaml"))
    assert r.name == "cpu_min" and r.parallel.world_size == 1 and r.validated == ()
    assert r.defaults.steps == 50 and r.serving.host == "127.0.0.1" and r.serving.port == 8091


def test_validated_entries_are_frozen_mappings(tmp_path):
    r = load_recipe(write(tmp_path, "validated:\n  - {date: 2025-10-02, hardware: 1x H200, commit: abc1234, "
                                    "images_per_min: 3.5}\n"))
    (entry,) = r.validated
    assert isinstance(entry, FrozenDict)
    assert dict(entry) == {"date": "2025-10-02", "hardware": "1x H200", "commit": "abc1234", "images_per_min": 3.5}
    with pytest.raises(TypeError):
        entry["commit"] = "def"  # type: ignore[index]


def test_yaml_scientific_notation_is_a_number(tmp_path):
    assert load_recipe(write(tmp_path, "step_cache: {threshold: 1e-3}\n")).step_cache.threshold == 1e-3


# ------------------------------------------------------------------ parsing helpers


@pytest.mark.parametrize("text, expected", [
    (1024, 1024), ("1024", 1024), ("2GiB", 2 << 30), ("2 GiB", 2 << 30), ("512MiB", 512 << 20),
    ("1.5GiB", 3 << 29), ("2GB", 2 * 10**9), ("16KiB", 16384), ("1KB", 1000), ("7B", 7), ("1TiB", 1 << 40),
    ("2gib", 2 << 30),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["2 gigs", "-1GiB", "GiB", "0.5B", "1.1KiB x", True, None, 2.5])
def test_parse_bytes_rejects(text):
    with pytest.raises(RecipeError):
        parse_bytes(text)


def test_parse_size():
    assert parse_size("1024x768") == (1024, 768)
    assert parse_size(" 896X1152 ") == (896, 1152)
    for bad in ("1024", "1024x", "0x1024", "axb", "1024*1024", 1024):
        with pytest.raises(RecipeError, match="WIDTHxHEIGHT"):
            parse_size(bad)


def test_requirements():
    assert parse_requirement("omni-run>=0.1,<0.3") == ("omni-run", [(">=", (0, 1)), ("<", (0, 3))])
    assert parse_requirement("omni-run") == ("omni-run", [])
    assert unmet_requirement("") is None
    assert unmet_requirement("omni-run>=0.1") is None
    assert unmet_requirement("omni-run~=0.1") is None
    assert "is installed" in unmet_requirement("omni-run>=99")
    assert "omni-run-nonexistent-xyz is not installed" in unmet_requirement("omni-run-nonexistent-xyz>=1")
    for bad in ("omni-run>>1", "omni-run>=a", "omni-run~=1", ">=1"):
        with pytest.raises(RecipeError):
            parse_requirement(bad)


# ------------------------------------------------------------------ frozen, replace, patches


def test_recipe_is_frozen():
    r = load_recipe("cpu_tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.parallel.tp = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "other"  # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):
        r.extra = 1  # slots: no new attributes  # type: ignore[attr-defined]


def test_recipe_is_hashable_and_picklable_for_workers():
    r = load_recipe("h200_fp8")
    assert pickle.loads(pickle.dumps(r)) == r
    assert hash(r) == hash(load_recipe("h200_fp8"))


def test_direct_construction_validates_too():
    with pytest.raises(RecipeError, match="tp: must be >= 1"):
        dataclasses.replace(load_recipe("cpu_tiny").parallel, tp=0)
    with pytest.raises(RecipeError, match="name: missing required key"):
        parse_recipe("platform: cpu\n")


def test_replace_path_returns_a_new_validated_recipe():
    r = load_recipe("cpu_tiny")
    r2 = r.replace_path("kv_cache.budget_bytes", "1GiB")
    assert r2.kv_cache.budget_bytes == 1 << 30 and r.kv_cache.budget_bytes == 16 << 20
    assert r2.get_path("kv_cache.budget_bytes") == 1 << 30
    assert r.replace_path("attention.backend", "sdpa").attention.backend == "sdpa"
    assert r.replace_path("model.path", "/ckpt").model.path == "/ckpt"


@pytest.mark.parametrize("path, value, expected", [
    ("attention.backend", "fa4", "recipe cpu_tiny: attention.backend: 'fa4' is not allowed; allowed values: auto"),
    ("parallel.tpp", 2, "recipe cpu_tiny: parallel.tpp: unknown key 'tpp'; allowed: tp, ep"),
    ("paralel.tp", 2, "recipe cpu_tiny: paralel: unknown key 'paralel'"),
    ("parallel", {"tp": 2}, "parallel: is a section; change its keys (tp, ep"),
    ("parallel.tp.x", 2, "parallel.tp: is not a section"),
    ("parallel.tp", 2, "device.count: 1 device(s) but the parallel world size is 2"),
    ("serving.port", "8091", "serving.port: expected an integer, got str '8091'"),
])
def test_replace_path_errors(path, value, expected):
    with pytest.raises(RecipeError) as info:
        load_recipe("cpu_tiny").replace_path(path, value)
    assert expected in str(info.value)


def test_replace_paths_is_atomic():
    r = load_recipe("cpu_tiny").replace_paths({"parallel.tp": 2, "device.count": 2})
    assert (r.parallel.world_size, r.device.count) == (2, 2)


def test_apply_patches_logs_each_changed_field_with_the_reason():
    from omni.specs import PlanPatch

    r = load_recipe("cpu_tiny")
    lines: list[str] = []
    patches = [
        PlanPatch(changes={"attention.backend": "sdpa", "graph.mode": "eager"}, reason="cpu: no varlen kernel"),
        PlanPatch(changes={"kv_cache.budget_bytes": "32MiB"}, reason="cpu: bigger pool"),
    ]
    out = apply_patches(r, patches, lines.append)
    assert out.attention.backend == "sdpa" and out.kv_cache.budget_bytes == 32 << 20
    assert r.attention.backend == "auto", "the input recipe is untouched"
    assert lines == [
        "plan patch: attention.backend: 'auto' -> 'sdpa' (cpu: no varlen kernel)",
        f"plan patch: kv_cache.budget_bytes: {16 << 20} -> {32 << 20} (cpu: bigger pool)",
    ], "unchanged fields (graph.mode) are not logged"
    assert apply_patches(r, [], lines.append) is r


def test_invalid_patch_names_its_reason():
    from omni.specs import PlanPatch

    with pytest.raises(RecipeError, match=r"plan patch \(npu: fia only\) is invalid: .*attention.backend: 'fia2'"):
        apply_patches(load_recipe("cpu_tiny"), [PlanPatch(changes={"attention.backend": "fia2"},
                                                          reason="npu: fia only")], print)


# ------------------------------------------------------------------ surface and boundaries


def test_recipe_surface_is_frozen():
    assert field_paths() == RECIPE_FIELD_PATHS


def test_every_field_is_documented():
    rows = schema_rows()
    assert [r[0] for r in rows] == RECIPE_FIELD_PATHS
    for path, allowed, default, doc in rows:
        assert allowed and default and len(doc) > 10, path


def test_quant_schemes_match_the_platform_contract():
    from omni import recipe, specs

    assert recipe.QUANT_SCHEMES == specs.QUANT_SCHEMES


@pytest.mark.parametrize("module", ["recipe", "recipe_fields", "recipe_schema"])
def test_recipe_module_is_light_and_reads_no_environment(module):
    code = f"import sys, omni.{module}; assert 'torch' not in sys.modules, 'omni.{module} imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
    tree = ast.parse((ROOT / "core" / f"{module}.py").read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
            {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
            {a.name.rpartition(".")[2] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names}
    assert not names & {"environ", "getenv", "environb", "getenvb"}, module


def test_recipe_class_fields_are_kw_only_frozen_slots():
    from omni import recipe

    for cls in [Recipe] + [f.type for f in dataclasses.fields(Recipe) if dataclasses.is_dataclass(f.type)]:
        params = cls.__dataclass_params__
        assert params.frozen and "__slots__" in cls.__dict__, cls
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls
    assert recipe.Recipe is Recipe


def test_command_line_overrides_parse_as_yaml_and_refuse_an_item_without_a_value():
    from omni.recipe import parse_overrides

    assert parse_overrides(["kernels.fuse_shared_expert=true", " device.memory_gib = 139", "model.path="]) == {
        "kernels.fuse_shared_expert": True, "device.memory_gib": 139, "model.path": None}
    for bad in ("kernels.fuse_shared_expert", "=1"):
        with pytest.raises(RecipeError, match=rf"--set expects KEY=VALUE, got '{bad}'"):
            parse_overrides([bad])
