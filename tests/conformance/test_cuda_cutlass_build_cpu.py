"""The cuda platform's CUTLASS grouped fp8 kernel: its build, checked on a CPU box with a recording stand-in for
nvcc (a real executable script): cache key, compile command, lock + atomic rename, cache hits, a failing compiler,
the prebuild side by side, the self-test before an object is opened, finding the compiler and the headers."""
from __future__ import annotations

import dataclasses
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from cutlass_doubles import H200, MOE, load_doubles, record_prebuild
from omni.platforms.cuda import cutlass_grouped as cg
from omni.platforms.cuda import gemm, moe

# the prebuild recorded (autouse) and the build-and-load step answered by fp32 doubles: cutlass_doubles
prebuilt = pytest.fixture(autouse=True)(record_prebuild)
loaded = pytest.fixture(load_doubles)


# ----------------------------------------------------------------- the build


@pytest.fixture
def fake_nvcc(tmp_path):
    """An executable that answers --version and 'compiles' by writing the -o file; it logs each compile."""
    script = tmp_path / "nvcc"
    log = tmp_path / "compiles.log"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0; fi
if [ -n "$FAIL_NVCC" ]; then echo "grouped_fp8.cu(1): error: something is wrong" >&2; exit 2; fi
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
echo "$@" >> {log}
echo "ELF" > "$out"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    include = tmp_path / "cutlass" / "include"
    (include / "cutlass").mkdir(parents=True)
    (include / "cutlass" / "cutlass.h").write_text("// header\n")
    (include / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 4\n")
    return script, include, log


def test_build_compiles_once_into_the_cache(fake_nvcc, tmp_path):
    nvcc, include, log = fake_nvcc
    cfg = cg.CONFIGS[True]
    first = cg.build(cfg, str(nvcc), str(include), tmp_path / "cache")
    again = cg.build(cfg, str(nvcc), str(include), tmp_path / "cache")
    assert first == again and first.read_text() == "ELF\n" and first.name.startswith(f"grouped_fp8_{cfg.name}_")
    compiles = log.read_text().splitlines()
    assert len(compiles) == 1, compiles  # the second build was a cache hit
    argv = compiles[0].split()
    assert "-arch=sm_90a" in argv and f"-I{include}" in argv and "-shared" in argv
    unit = first.with_suffix(".cu").read_text()
    assert cfg.export_line() in unit and str(cg.SOURCE) in unit
    assert not list((tmp_path / "cache").glob("*.tmp"))


def test_a_failing_compiler_raises_with_its_message_and_leaves_nothing(fake_nvcc, tmp_path, monkeypatch):
    nvcc, include, _ = fake_nvcc
    monkeypatch.setenv("FAIL_NVCC", "1")
    with pytest.raises(RuntimeError, match=r"nvcc failed \(2\) building pong_128x128_c1x2_fast:\n.*error: "
                                           r"something is wrong"):
        cg.build(cg.CONFIGS[True], str(nvcc), str(include), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.so")) and not list((tmp_path / "cache").glob("*.tmp"))


@pytest.fixture
def loading(fake_nvcc, tmp_path, monkeypatch):
    """``cg.load`` on this CPU machine: the fake compiler, a kernel cache in tmp, device 0 of a made-up model,
    and the ctypes wrapper recorded instead of opened (the fake object is no ELF)."""
    nvcc, include, log = fake_nvcc
    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path / "kcache"))
    monkeypatch.setattr(cg.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cg, "device_tag", lambda device: f"NVIDIA-H200-sm90-driver13000-dev{device}")
    opened = []
    monkeypatch.setattr(cg, "CutlassGroupedFp8", lambda library, config: opened.append((library, config)) or config)
    return str(nvcc), str(include), opened, tmp_path / "kcache"


def test_the_swiglu_epilogue_is_its_own_object_and_self_test(loading):
    nvcc, include, opened, cache = loading
    tested = []
    assert cg.load(True, nvcc, include, tester=lambda *a: tested.append(a), swiglu=True) == \
        "pong_128x192_c1x2_fast_swiglu"
    cg.load(True, nvcc, include, tester=lambda *a: tested.append(a))
    assert [(lib.name.split("_")[-2], cfg) for lib, cfg, _ in tested] == [
        ("swiglu", "pong_128x192_c1x2_fast_swiglu"), ("fast", "pong_128x128_c1x2_fast")]
    assert len(list(cache.glob("*.ok-*"))) == 2


def test_prebuild_compiles_side_by_side_and_reports_each_failure(fake_nvcc, tmp_path, monkeypatch):
    """Every configuration a fast recipe may load is compiled (one nvcc each); a failing compile is returned as
    its error, not raised, so ``load`` reports it itself; the small builds exist for fast accumulation only."""
    nvcc, include, log = fake_nvcc
    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path / "kcache"))
    configs = [cg.config_of(True, swiglu, small) for swiglu in (False, True) for small in (False, True)]
    assert [c.name for c in configs] == ["pong_128x128_c1x2_fast", "pong_64x128_c1x1_fast",
                                         "pong_128x192_c1x2_fast_swiglu", "pong_64x128_c1x1_fast_swiglu"]
    built = cg.prebuild(configs, str(nvcc), str(include))
    assert all(isinstance(b, Path) and b.exists() for b in built) and len(log.read_text().splitlines()) == 4
    assert cg.config_of(False, small=True) is None
    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("FAIL_NVCC", "1")
    failed = cg.prebuild(configs[:2], str(nvcc), str(include))
    assert all(isinstance(f, RuntimeError) and "nvcc failed (2)" in str(f) for f in failed)


def test_prebuild_self_tests_side_by_side_and_load_keeps_the_verdicts(loading):
    """With a device, each object's self-test runs in the prebuild, all at once (a barrier that one test at a
    time would never pass); ``load`` then opens the objects without a child. A failed test is its result, with
    no verdict kept, so ``load`` tests again and raises it."""
    nvcc, include, opened, cache = loading
    configs = gemm.prebuild_configs(True, True)
    together = threading.Barrier(len(configs), timeout=20)
    tested = []
    built = cg.prebuild(configs, nvcc, include, device=0, tester=lambda *a: tested.append(a) or together.wait())
    assert all(isinstance(b, Path) for b in built) and sorted(t[1] for t in tested) == sorted(c.name for c in configs)
    assert len(list(cache.glob("*.ok-NVIDIA-H200-sm90-driver13000-dev0"))) == len(configs)
    assert cg.load(True, nvcc, include, tester=pytest.fail, swiglu=True, small=True) == configs[-1].name

    def fails(library, config, device):
        raise RuntimeError(f"the self-test of {config} failed in a child process (exit 1)")

    for ok in cache.glob("*.ok-*"):
        ok.unlink()
    [failed] = cg.prebuild(configs[:1], nvcc, include, device=0, tester=fails)
    assert isinstance(failed, RuntimeError) and not list(cache.glob("*.ok-*"))
    with pytest.raises(RuntimeError, match="failed in a child process"):
        cg.load(True, nvcc, include, tester=fails)


def test_ranks_asking_at_once_share_one_self_test(loading):
    """Four threads (as the ranks of one host, one device model, would) ask for one object's verdict at once: one
    test runs, the others wait on the object's lock and find its verdict."""
    nvcc, include, _, cache = loading
    cfg = cg.CONFIGS[True]
    library = cg.build(cfg, nvcc, include)
    tested, start = [], threading.Barrier(4, timeout=20)

    def slow_test(*args):
        tested.append(args)
        time.sleep(0.2)

    def ask():
        start.wait()
        cg.self_tested(library, cfg.name, 0, slow_test)
    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(tested) == 1 and len(list(cache.glob("*.ok-*"))) == 1


def test_prebuild_compiles_small_tiles_only_where_the_recipe_uses_them(loaded, prebuilt):
    """``kernels.grouped_fp8_small_rows: 0`` compiles no 64-row object; exact accumulation has none to compile."""
    names = {(fast, small): [c.name for c in gemm.prebuild_configs(fast, small)]
             for fast in (True, False) for small in (True, False)}
    assert names[True, False] == ["pong_128x128_c1x2_fast", "pong_128x192_c1x2_fast_swiglu"]
    assert names[True, True] == names[True, False][:1] + ["pong_64x128_c1x1_fast"] + names[True, False][1:] + [
        "pong_64x128_c1x1_fast_swiglu"]
    assert names[False, True] == names[False, False] and not any("64x128" in n for n in names[False, True])
    moe.resolve_moe(dataclasses.replace(MOE, fast_accum=True), H200, pytest.fail)
    assert prebuilt and all(args[0] is True and args[3] is True for args in prebuilt)


def test_no_small_build_with_exact_accumulation(loading):
    nvcc, include, _, _ = loading
    with pytest.raises(RuntimeError, match="no small-tile build with fast_accum=False"):
        cg.load(False, nvcc, include, tester=pytest.fail, small=True)


def test_the_self_test_runs_once_per_device_model_before_the_object_is_opened(loading):
    nvcc, include, opened, cache = loading
    tested = []
    assert cg.load(True, nvcc, include, tester=lambda *a: tested.append(a)) == "pong_128x128_c1x2_fast"
    [(library, config, device)] = tested
    assert (config, device) == ("pong_128x128_c1x2_fast", 0) and opened == [(library, config)]
    assert (cache / f"{library.stem}.ok-NVIDIA-H200-sm90-driver13000-dev0").exists()
    cg.load(True, nvcc, include, tester=lambda *a: tested.append(a))
    assert len(tested) == 1 and len(opened) == 2  # the verdict is kept: no second child


def test_a_failed_self_test_opens_nothing_and_keeps_no_verdict(loading):
    nvcc, include, opened, cache = loading

    def fails(library, config, device):
        raise RuntimeError("the self-test of pong_128x128_c1x2_fast failed in a child process (exit 1)")

    with pytest.raises(RuntimeError, match="failed in a child process"):
        cg.load(True, nvcc, include, tester=fails)
    assert opened == [] and not list(cache.glob("*.ok-*"))


def test_the_child_reports_its_failure_with_its_output(tmp_path):
    """A real child process that cannot open its object (on any machine): the parent raises with the child's error."""
    with pytest.raises(RuntimeError, match=r"failed in a child process \(exit 1\):\n(.|\n)*missing\.so: cannot open"):
        cg.test_in_child(tmp_path / "missing.so", "pong_128x128_c1x2_fast", 0)


def test_cache_key_follows_source_config_compiler_and_headers(fake_nvcc):
    _, include, _ = fake_nvcc
    fast, exact = cg.CONFIGS[True], cg.CONFIGS[False]
    key = cg.cache_key(fast, "release 13.0", str(include))
    assert key == cg.cache_key(fast, "release 13.0", str(include))
    assert key != cg.cache_key(exact, "release 13.0", str(include))
    assert key != cg.cache_key(fast, "release 13.1", str(include))
    (include / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 5\n")
    assert key != cg.cache_key(fast, "release 13.0", str(include))


def test_exported_configurations_are_read_from_the_symbols(tmp_path):
    library = tmp_path / "lib.so"
    library.write_bytes(b"\x7fELF..omni_gg_pong_128x128_c1x2_fast_run\x00omni_gg_pong_128x128_c1x2_fast_scratch\x00"
                        b"omni_gg_coop_128x256_c1x1_fast_run\x00omni_gg_coop_128x256_c1x1_fast_run\x00")
    assert cg.exported_configs(library) == ["coop_128x256_c1x1_fast", "pong_128x128_c1x2_fast"]


def test_configs_name_their_template_arguments():
    assert cg.CONFIGS[True].export_line() == \
        "OMNI_GG_EXPORT(pong_128x128_c1x2_fast, 128, 128, 128, 1, 2, true, true, 0)"
    assert cg.CONFIGS[False].name == "coop_128x128_c1x2_exact"
    assert cg.SWIGLU_CONFIGS[True].export_line() == \
        "OMNI_GG_EXPORT(pong_128x192_c1x2_fast_swiglu, 128, 192, 128, 1, 2, true, true, 1)"
    assert "OMNI_GG_EXPORT(NAME, TM, TN, TK, CM, CN, PONG, FAST, EPI)" in cg.SOURCE.read_text()


def test_finding_the_compiler_and_the_headers(fake_nvcc, monkeypatch, tmp_path):
    nvcc, include, _ = fake_nvcc
    cuda_home = tmp_path / "cuda"
    (cuda_home / "bin").mkdir(parents=True)
    os.symlink(nvcc, cuda_home / "bin" / "nvcc")
    monkeypatch.setenv("CUDA_HOME", str(cuda_home))
    assert cg.find_nvcc() == str(cuda_home / "bin" / "nvcc")
    monkeypatch.setenv("OMNI_CUTLASS_INCLUDE", str(include))
    assert cg.find_cutlass_include() == str(include)
    monkeypatch.setenv("OMNI_CUTLASS_INCLUDE", str(tmp_path))  # no cutlass/cutlass.h there
    assert cg.find_cutlass_include() is None
    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path / "k"))
    assert cg.cache_dir() == Path(tmp_path / "k")
