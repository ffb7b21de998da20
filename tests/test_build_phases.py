"""Where a build's seconds go (``PhaseClock``, the ``pipeline ready in ...`` line), and the two imports the build
no longer pays: ``torch._refs`` (an embedding's init on the meta device) and sympy (``empty_like`` of a meta
tensor), 1.9 s of the default CPU job's 2.1 s build on the development machine (BENCHMARKS.md, "Fortieth
session")."""
from __future__ import annotations

import logging
import re
import subprocess
import sys
import time

import pytest
import torch

from omni.layers import embedding
from omni.phase_clock import PhaseClock
from omni.weights import materialize_meta_


def phases_of(summary: str) -> tuple[float, dict[str, float]]:
    """``"1.2 s (a 0.3, b 0.9)"`` -> ``(1.2, {"a": 0.3, "b": 0.9})``."""
    m = re.fullmatch(r"(\d+\.\d) s \((.*)\)", summary)
    assert m, summary
    return float(m[1]), {name: float(s) for name, s in (p.rsplit(" ", 1) for p in m[2].split(", "))}


def test_each_phase_ends_by_waiting_for_the_device_and_summary_names_the_rest():
    waited = []
    clock = PhaseClock()
    clock.sync = lambda: waited.append(time.perf_counter())
    with clock.phase("weights"):
        time.sleep(0.02)
    time.sleep(0.3)  # outside every phase: reported as "other"
    with clock.phase("weights"):
        pass
    with clock.phase("KV pool"):
        pass
    assert len(waited) == 3 and list(clock.seconds) == ["weights", "KV pool"]
    assert 0.02 <= clock.seconds["weights"] < 0.3  # the sleep between the two blocks is not the phase's
    total, parts = phases_of(clock.summary())
    assert list(parts) == ["weights", "KV pool", "other"] and parts["other"] >= 0.3 and total >= 0.3, parts


def test_a_phase_that_raises_is_not_timed_and_its_error_is_unchanged():
    clock = PhaseClock(sync=lambda: pytest.fail("no wait after a failed phase"))
    with pytest.raises(KeyError, match="bad"):
        with clock.phase("weights"):
            raise KeyError("bad")
    assert clock.seconds == {} and clock.summary() == f"{clock.total():.1f} s"


def test_embedding_skips_its_init_on_meta_and_keeps_it_on_a_real_device():
    with torch.device("meta"):
        meta = embedding(64, 8, dtype=torch.bfloat16, padding_idx=3)
    assert meta.weight.is_meta and meta.weight.dtype == torch.bfloat16 and meta.padding_idx == 3
    torch.manual_seed(0)
    real = embedding(64, 8, dtype=torch.float32, padding_idx=3)
    torch.manual_seed(0)
    want = torch.nn.Embedding(64, 8, padding_idx=3)
    assert torch.equal(real.weight, want.weight) and not real.weight[3].any()


def test_materialize_keeps_a_meta_tensors_strides():
    module = torch.nn.Module()
    with torch.device("meta"):
        module.w = torch.nn.Parameter(torch.empty(2, 8, 3, 3).to(memory_format=torch.channels_last))
        module.register_buffer("b", torch.empty(4, 6).t())
    assert materialize_meta_(module, "cpu") == 2
    assert module.w.stride() == (72, 1, 24, 8) and module.w.device.type == "cpu"
    assert isinstance(module.w, torch.nn.Parameter) and module.b.stride() == (1, 6) and module.b.shape == (6, 4)


def test_the_build_logs_its_phases(caplog):
    from omni.deployment import prepare

    with caplog.at_level(logging.INFO, logger="omni.hunyuan_image3"):
        prepare("cpu_tiny").build_pipeline(progress=False)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("pipeline ready in "))
    total, parts = phases_of(line.removeprefix("pipeline ready in ").split(":")[0])
    want = ["device", "modules", "first layer", "other layers", "outside the layers", "KV pool", "engine"]
    assert list(parts)[:7] == want and sum(parts.values()) <= total + 0.05 * len(parts), line


BUILD_IMPORTS = """
import sys
from omni.deployment import prepare
d = prepare("cpu_tiny")
before = set(sys.modules)
d.build_pipeline(progress=False)
print(" ".join(sorted(m for m in set(sys.modules) - before if m.split(".")[0] == "sympy" or m == "torch._refs")))
"""


def test_the_default_build_imports_neither_torch_refs_nor_sympy():
    done = subprocess.run([sys.executable, "-c", BUILD_IMPORTS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", f"the build imported: {done.stdout[:300]}"
