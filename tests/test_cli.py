"""The omni-run command line: in-process through main([...]) and as a subprocess.

generate/serve/bench hand over to modules written elsewhere; here they are
replaced by recording fakes in ``sys.modules`` so the tests check the CLI's
contract (exit codes, the frozen Deployment and job handed over) and never run a model.
"""
import argparse
import logging
import os
import subprocess
import sys
import types

import pytest
import torch

from omni.cli import build_parser, main
from omni.recipe import load_recipe

BUILTIN_PLATFORMS = ("cpu", "cuda", "rocm", "npu", "xpu", "musa")

# The CLI surface, frozen: changing it is a deliberate change for every user and script.
CLI_SURFACE = {
    "": ["--api-key", "--help", "--host", "--log-level", "--model", "--platform", "--port", "--recipe", "--set",
         "--trace", "--version", "-h"],
    "platforms": ["--help", "--log-level", "--trace", "-h"],
    "models": ["--help", "--log-level", "--trace", "-h"],
    "recipes": ["--check", "--docs", "--help", "--log-level", "--platform", "--schema", "--trace", "-h"],
    "generate": ["--bot-task", "--cot-max-tokens", "--drop-think", "--guidance", "--help", "--latents", "--log-level",
                 "--model", "--negative-prompt", "--output", "--platform", "--prompt", "--recipe", "--seed", "--set",
                 "--size", "--steps", "--trace", "--verbose", "-h", "-o", "-v"],
    "edit": ["--bot-task", "--cot-max-tokens", "--drop-think", "--guidance", "--help", "--image", "--latents",
             "--log-level", "--model", "--negative-prompt", "--output", "--platform", "--prompt", "--recipe", "--seed",
             "--set", "--size", "--steps", "--trace", "--verbose", "-h", "-o", "-v"],
    "chat": ["--help", "--image", "--log-level", "--max-tokens", "--model", "--platform", "--prompt", "--recipe",
             "--seed", "--set", "--system-prompt", "--temperature", "--top-k", "--top-p", "--trace", "-h"],
    "serve": ["--api-key", "--help", "--host", "--log-level", "--model", "--platform", "--port", "--ray",
              "--ray-address", "--recipe", "--set", "--trace", "-h"],
    "bench": [],  # everything after `bench` goes to the benchmark client
}


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni.cli", *argv], capture_output=True, text=True, timeout=120)


@pytest.fixture(autouse=True)
def _restore_log_levels():
    levels = {name: logging.getLogger(name).level for name in ("omni", "omni.platforms")}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture
def handover(monkeypatch):
    """Install recording fakes for omni.generate / omni.serving.server / omni.bench_client."""
    calls: list[tuple] = []

    def fake(module: str, attr: str, result=0):
        def entry(*args):
            calls.append(args)
            if isinstance(result, BaseException):
                raise result
            return result

        parent = module.rpartition(".")[0]
        if parent != "omni":
            package = types.ModuleType(parent)
            package.__path__ = []
            monkeypatch.setitem(sys.modules, parent, package)
        mod = types.ModuleType(module)
        setattr(mod, attr, entry)
        monkeypatch.setitem(sys.modules, module, mod)
        return calls

    return fake


def _cuda_first() -> str | None:
    """The refusal a cuda recipe gets first on this machine when CUDA is not usable here (None: it is)."""
    from omni.platform_manager import detect, discover

    return None if detect("cuda", discover()["cuda"]).info else "platform 'cuda' is not usable here"


CUDA_FIRST = _cuda_first()


def recipe_file(tmp_path, text: str, name: str = "x_test.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ help and surface


def test_help_teaches_every_command():
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("platforms", "recipes", "generate", "edit", "chat", "serve", "bench"):
        assert command in result.stdout
    assert "examples:" in result.stdout and "exit status" in result.stdout


def test_no_arguments_serves_as_the_help_says(handover):
    calls = handover("omni.serving.server", "serve_main")
    assert main([]) == 0
    [(deployment, endpoint)] = calls
    assert deployment.recipe.name == "cpu_tiny" and (endpoint.host, endpoint.port) == ("127.0.0.1", 8091)


def test_console_script_is_installed():
    import shutil

    exe = shutil.which("omni-run")
    if exe is None:
        pytest.skip("omni-run is not on PATH (package not installed)")
    assert subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120).returncode == 0


def test_cli_surface_is_frozen():
    parser = build_parser()
    surface = {"": sorted(o for a in parser._actions for o in a.option_strings)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                surface[name] = sorted(o for a in sub._actions for o in a.option_strings)
    assert surface == CLI_SURFACE


def test_usage_errors_exit_2(capsys):
    assert main(["serve", "--bogus"]) == 2
    assert main(["generate"]) == 2  # --prompt is required
    assert main(["generate", "--prompt", "x", "--steps", "many"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# ------------------------------------------------------------------ platforms


def test_platforms_lists_every_builtin_platform(capsys):
    assert main(["platforms"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1] for line in lines[1:] if line.strip() and not line.startswith("--")}
    assert set(BUILTIN_PLATFORMS) <= set(rows)
    assert rows["cpu"] == "yes"
    assert lines[-1].startswith("--platform auto selects:")


def test_platforms_as_subprocess():
    result = run_cli("platforms")
    assert result.returncode == 0, result.stderr
    for name in BUILTIN_PLATFORMS:
        assert f"\n{name} " in result.stdout


# ------------------------------------------------------------------ recipes


def test_recipes_lists_and_validates_packaged_recipes(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "cpu_tiny" in out and "h200_fp8" in out and "error" not in out


def test_recipes_checks_against_a_platform(capsys):
    assert main(["recipes", "--platform", "cpu"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "ok (checked on cpu)" in rows["cpu_tiny"]
    assert "skipped (platform cuda)" in rows["h200_fp8"]


def test_recipes_unknown_platform_exits_2(capsys):
    assert main(["recipes", "--platform", "tpu"]) == 2
    assert "unknown platform 'tpu'; installed: " in capsys.readouterr().err


def test_recipes_check_bad_file_exits_2_with_one_line(tmp_path):
    bad = recipe_file(tmp_path, "platform: cpu\nparallel: {tp: 1, tpp: 2}\n", "bad.yaml")
    result = run_cli("recipes", "--check", bad)
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line == f"omni-run: error: {bad}: parallel.tpp: unknown key 'tpp'; allowed: tp, ep, ulysses, ring, cfg, dp"


def test_recipes_check_good_file(tmp_path, capsys):
    good = recipe_file(tmp_path, "name: cpu_mine\nplatform: cpu\n")
    assert main(["recipes", "--check", good]) == 0
    assert capsys.readouterr().out.strip() == "ok: cpu_mine"
    assert main(["recipes", "--check", good, "--platform", "cpu"]) == 0


def test_recipes_check_for_another_platform_exits_2(capsys):
    assert main(["recipes", "--check", "h200_fp8", "--platform", "cpu"]) == 2
    assert "is for platform cuda, not cpu" in capsys.readouterr().err


def test_recipes_schema(capsys):
    assert main(["recipes", "--schema"]) == 0
    out = capsys.readouterr().out
    assert "parallel.ulysses" in out and "kv_cache.budget_bytes" in out


# ------------------------------------------------------------------ generate


def test_generate_hands_over_the_deployment_and_a_resolved_job(handover, capsys):
    calls = handover("omni.generate", "generate_main")
    assert main(["generate", "--prompt", "a red fox", "--seed", "7", "--trace"]) == 0
    ((deployment, job),) = calls
    assert deployment.recipe == load_recipe("cpu_tiny") and deployment.trace
    req = job.request
    assert (req.prompt, req.seed, str(job.output), job.latents) == ("a red fox", 7, "out.png", None)
    assert (req.width, req.height, req.steps, req.guidance) == (128, 128, 20, 5.0)
    assert req.negative_prompt is None  # None: the official <cfg>-token unconditional row


def test_generate_flags_win_over_recipe_defaults(handover, tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))  # --model must hold safetensors
    calls = handover("omni.generate", "generate_main")
    assert main(["generate", "--prompt", "x", "--size", "768x512", "--steps", "3", "--guidance", "0",
                 "--model", str(tmp_path), "-o", "y.png", "--latents", "z.safetensors"]) == 0
    ((deployment, job),) = calls
    req = job.request
    assert (req.width, req.height, req.steps, req.guidance, str(job.output)) == (768, 512, 3, 0.0, "y.png")
    assert str(job.latents) == "z.safetensors" and req.return_latents
    assert deployment.recipe.model.path == os.path.abspath(tmp_path)


def test_set_overrides_recipe_keys_and_the_named_flags_win(handover, tmp_path):
    """--set KEY=VALUE changes one recipe key for this run (checked like the file, before anything loads); the
    items before the command and the command's own add up; --model / --port name their key outright and win
    over a --set of the same key."""
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    calls = handover("omni.serving.server", "serve_main")
    assert main(["--set", "serving.max_running=3", "serve", "--set", "device.expandable_segments=true",
                 "--set", "serving.port=0", "--port", "9002", "--set", "model.path=/nowhere",
                 "--model", str(tmp_path)]) == 0
    [(deployment, endpoint)] = calls
    r = deployment.recipe
    assert (r.serving.max_running, r.device.expandable_segments, endpoint.port) == (3, True, 9002)
    assert r.model.path == os.path.abspath(tmp_path)


@pytest.mark.parametrize("item, message", [
    ("serving.max_running", "--set expects KEY=VALUE, got 'serving.max_running'"),
    ("serving.max_runing=2", "serving.max_runing: unknown key 'max_runing'"),
    ("serving.max_running=lots", "serving.max_running: "),
])
def test_a_bad_set_exits_2_naming_it_before_anything_runs(handover, capsys, item, message):
    calls = handover("omni.generate", "generate_main")
    assert main(["generate", "--prompt", "x", "--set", item]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omni-run: error: ") and message in err
    assert not calls


def test_generate_exit_status_and_runtime_errors(handover, capsys):
    handover("omni.generate", "generate_main", result=RuntimeError("boom"))
    assert main(["generate", "--prompt", "x"]) == 1
    assert capsys.readouterr().err.strip() == "omni-run: error: RuntimeError: boom"


@pytest.mark.parametrize("argv, message", [
    (["--size", "big"], "--size: expected WIDTHxHEIGHT"),
    (["--steps", "0"], "--steps must be 1..200, got 0"),
    (["--model", "/nonexistent/ckpt"], "model path '/nonexistent/ckpt' is not a directory"),
    (["--recipe", "nope"], "unknown recipe 'nope'; packaged recipes:"),
    (["--recipe", "h200_fp8"], CUDA_FIRST or "recipe h200_fp8 runs hunyuan_image3, which needs its weights"),
    (["--recipe", "h200_fp8", "--platform", "cuda"], CUDA_FIRST or "recipe h200_fp8 runs hunyuan_image3, which needs"),
    (["--recipe", "h200_fp8", "--platform", "cpu"], "recipe h200_fp8 is for platform cuda; --platform cpu conflicts"),
    (["--platform", "tpu"], "unknown platform 'tpu'; known: cpu, cuda, "),
    (["--size", "100000x100000"], "--size: 100000x100000 (WxH) is out of range"),
    (["--size", "4096x256"], "--size: 4096x256 (WxH) has aspect ratio beyond 4:1"),
    (["--guidance", "inf"], "--guidance must be a finite number in 0..30, got inf"),
    (["--guidance", "nan"], "--guidance must be a finite number in 0..30, got nan"),
    (["--guidance", "31"], "--guidance must be a finite number in 0..30"),
    (["--steps", "201"], "--steps must be 1..200, got 201"),
    (["--seed", "-1"], "--seed must be 0.."),
    (["--prompt", "a \udc80 b"], "--prompt: the text is not valid Unicode"),
])
def test_generate_configuration_errors_exit_2(handover, capsys, argv, message):
    """Each refusal names its flag (the API's bounds); the platform is checked before the weights are asked for."""
    calls = handover("omni.generate", "generate_main")
    assert main(["generate", "--prompt", "x", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omni-run: error: ") and message in err
    assert not calls


def test_a_model_directory_without_its_weights_exits_2_before_any_build(handover, capsys, tmp_path):
    """--model naming a directory with a config but no safetensors is refused like any bad flag: exit 2, naming
    model.path and what is missing, nothing built (an index with missing shards: tests/test_weights.py)."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"never read")
    calls = handover("omni.generate", "generate_main")
    assert main(["generate", "--prompt", "x", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omni-run: error: recipe cpu_tiny: model.path ") and "only safetensors" in err
    assert not calls


@pytest.mark.parametrize("output, message", [
    ("{tmp}/x.foo", "-o/--output {tmp}/x.foo: the extension picks the image format; use one of .bmp, .jpeg, .jpg, "),
    ("{tmp}", "-o/--output {tmp}: is a directory; name the image file (e.g. {tmp}/out.png)"),
    ("{tmp}/file/x.png", "-o/--output {tmp}/file/x.png: cannot write there (File exists)"),
])
def test_an_output_that_cannot_be_written_exits_2_before_generating(handover, capsys, tmp_path, output, message):
    """-o is checked before the engine runs: an image that could not be saved would be an image lost."""
    (tmp_path / "file").write_text("a file where the directory would go")
    calls = handover("omni.generate", "generate_main")
    assert main(["generate", "--prompt", "x", "-o", output.format(tmp=tmp_path)]) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
    assert not calls


def test_an_output_check_leaves_no_file_behind_and_an_existing_one_untouched(handover, tmp_path):
    calls = handover("omni.generate", "generate_main")
    kept = tmp_path / "kept.png"
    kept.write_bytes(b"earlier image")
    assert main(["generate", "--prompt", "x", "-o", str(tmp_path / "deep" / "new.webp")]) == 0
    assert main(["generate", "--prompt", "x", "-o", str(kept), "--latents", str(tmp_path / "z.safetensors")]) == 0
    assert [c[1].output for c in calls] == [tmp_path / "deep" / "new.webp", kept]
    assert (tmp_path / "deep").is_dir() and not (tmp_path / "deep" / "new.webp").exists()
    assert kept.read_bytes() == b"earlier image" and not (tmp_path / "z.safetensors").exists()


@pytest.mark.timeout(30)
def test_an_output_fifo_is_checked_without_opening_it(handover, tmp_path):
    """-o naming a FIFO (an image piped to another program) passes the check at once: opening a FIFO to probe
    it would wait for a reader that comes only once the image is written."""
    import os
    import stat

    fifo = tmp_path / "image.png"
    os.mkfifo(fifo)
    calls = handover("omni.generate", "generate_main")
    assert main(["generate", "--prompt", "x", "-o", str(fifo)]) == 0
    assert [c[1].output for c in calls] == [fifo] and stat.S_ISFIFO(fifo.stat().st_mode)


def test_bad_recipe_file_exits_2(handover, tmp_path, capsys):
    handover("omni.generate", "generate_main")
    bad = recipe_file(tmp_path, "attention: {backend: fa4}\n")
    assert main(["generate", "--prompt", "x", "--recipe", bad]) == 2
    assert f"omni-run: error: {bad}: attention.backend: 'fa4' is not allowed; allowed values:" \
        in capsys.readouterr().err


def test_unusable_platform_exits_2_with_the_managers_reason(handover, tmp_path, capsys):
    calls = handover("omni.generate", "generate_main")
    npu = recipe_file(tmp_path, "platform: npu\ndevice: {kind: a2}\n", "a2_tiny.yaml")
    assert main(["generate", "--prompt", "x", "--recipe", npu]) == 2
    err = capsys.readouterr().err
    assert "omni-run: error: platform 'npu' is not usable here: npu: " in err and "pip install 'omni-run[npu]'" in err
    assert not calls


def test_an_unusable_platform_is_reported_before_the_weights_are_asked_for(handover, capsys):
    """The issue's case: a2_tp4 (80B weights, --model needed) on a box without an NPU."""
    calls = handover("omni.serving.server", "serve_main")
    assert main(["--platform", "npu", "--recipe", "a2_tp4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omni-run: error: platform 'npu' is not usable here") and "--model" not in err
    assert "pip install 'omni-run[npu]'" in err and not calls


def test_auto_recipe_takes_the_platform_flag(handover, tmp_path):
    calls = handover("omni.generate", "generate_main")
    auto = recipe_file(tmp_path, "platform: auto\nmodel: {dtype: float32}\n", "any_tiny.yaml")
    assert main(["generate", "--prompt", "x", "--recipe", auto, "--platform", "cpu"]) == 0
    ((deployment, _),) = calls
    assert deployment.recipe.platform == "cpu", "the recipe handed over names the concrete platform"


def test_unmet_requirement_exits_2(handover, tmp_path, capsys):
    handover("omni.generate", "generate_main")
    future = recipe_file(tmp_path, "platform: cpu\nrequires: omni-run>=99\n")
    assert main(["generate", "--prompt", "x", "--recipe", future]) == 2
    assert "requires 'omni-run>=99' but omni-run" in capsys.readouterr().err


def test_missing_handover_module_is_a_runtime_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "omni.generate", None)  # import raises ModuleNotFoundError
    assert main(["generate", "--prompt", "x"]) == 1
    assert "'generate' is not available in this build (omni.generate is missing)" in capsys.readouterr().err


# ------------------------------------------------------------------ serve


def test_bare_form_serves(handover):
    calls = handover("omni.serving.server", "serve_main")
    assert main(["--platform", "cpu", "--recipe", "cpu_tiny", "--port", "9001"]) == 0
    ((deployment, endpoint),) = calls
    assert (deployment.recipe.platform, endpoint.host, endpoint.port, endpoint.api_key) == \
        ("cpu", "127.0.0.1", 9001, None)
    assert deployment.recipe.serving.port == 9001 and deployment.recipe.name == "cpu_tiny"


def test_serve_command(handover):
    calls = handover("omni.serving.server", "serve_main")
    assert main(["serve", "--host", "0.0.0.0", "--api-key", "k", "--log-level", "warning"]) == 0
    ((deployment, endpoint),) = calls
    assert (endpoint.host, endpoint.api_key, deployment.recipe.serving.host) == ("0.0.0.0", "k", "0.0.0.0")
    assert logging.getLogger("omni").level == logging.WARNING


def test_serve_reads_the_key_from_the_named_environment_variable(handover, tmp_path, monkeypatch, capsys):
    calls = handover("omni.serving.server", "serve_main")
    keyed = recipe_file(tmp_path, "platform: cpu\nserving: {api_key_env: OMNI_TEST_API_KEY}\n")
    monkeypatch.delenv("OMNI_TEST_API_KEY", raising=False)
    assert main(["serve", "--recipe", keyed]) == 2
    assert "serving.api_key_env names OMNI_TEST_API_KEY, which is not set" in capsys.readouterr().err
    monkeypatch.setenv("OMNI_TEST_API_KEY", "secret")
    assert main(["serve", "--recipe", keyed]) == 0
    assert calls[-1][1].api_key == "secret"


def test_serve_rejects_a_bad_port(handover, capsys):
    handover("omni.serving.server", "serve_main")
    assert main(["serve", "--port", "0"]) == 2
    assert "serving.port: must be in 1..65535, got 0" in capsys.readouterr().err


# ------------------------------------------------------------------ bench


def test_bench_passes_every_argument_through(handover):
    calls = handover("omni.bench_client", "bench_main")
    assert main(["bench", "--url", "http://127.0.0.1:8091", "--port", "1", "-n", "8", "--help"]) == 0
    assert calls == [(["--url", "http://127.0.0.1:8091", "--port", "1", "-n", "8", "--help"],)]


def test_bench_exit_status_is_passed_on(handover):
    handover("omni.bench_client", "bench_main", result=3)
    assert main(["bench"]) == 3


def test_output_piped_into_a_reader_that_leaves_early_is_not_an_error():
    """`omni-run recipes --schema | head`: no BrokenPipeError, exit status 0 (`true` leaves before any write)."""
    import subprocess
    import sys

    cmd = f"{sys.executable} -m omni.cli recipes --schema | true"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert "BrokenPipe" not in proc.stderr and "error" not in proc.stderr, proc.stderr
    assert proc.returncode == 0


def test_generate_runs_without_the_web_stack(tmp_path):
    """``omni-run generate`` checks its flags by the API's rules (omni.serving.limits) without importing
    FastAPI, Starlette, uvicorn or pydantic: they are the server's, and cost the CLI a part of its start. Its
    step bar starts once the pipeline is ready, so the loading bar stands alone and the step rate is the steps'."""
    out = tmp_path / "fox.png"
    code = ("import sys\nfrom omni.cli import main\n"
            f"rc = main(['generate', '--recipe', 'cpu_tiny', '--prompt', 'a red fox', '--steps', '1', "
            f"'--size', '64x64', '-o', {str(out)!r}])\n"
            "print('WEB', sorted(m for m in ('fastapi', 'starlette', 'uvicorn', 'pydantic') if m in sys.modules))\n"
            "sys.exit(rc or 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "WEB []" in done.stdout, done.stdout[-500:]
    assert out.stat().st_size > 0
    assert 0 <= done.stderr.index("pipeline ready") < done.stderr.index("denoising:"), done.stderr[-2000:]
