"""The shared expert beside the routed path (``kernels.shared_expert_stream``, ``omni.streams``).

- ``SideStream`` against a recording device double: the side stream waits for the current one before the
  work, the work is enqueued with the side stream current, and ``join`` makes the current stream wait for
  the side one; one stream per ``SideStream``, made with the requested priority.
- The CPU platform has no streams: ``side_stream()`` is ``INLINE`` and the recipe field changes no number.
- A MoE layer runs its shared expert on its side stream, unless a parallel plan hooked the shared expert
  (its collectives keep to the current stream); decided once, at the first forward.
- The MoE kernel resolves callable addends right before its combine, after the routed experts' GEMMs
  (the CUDA MoE on its torch kernels and torch's grouped GEMM, which run on CPU tensors), and once.
"""
from __future__ import annotations

import contextlib

import torch

from omni.build_options import BuildOptions
from omni.platform_manager import select
from omni.streams import INLINE, SideStream


class RecordingStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")


class RecordingServices:
    """The ``DeviceServices`` surface ``SideStream`` uses, recording every call in order."""

    def __init__(self):
        self.log, self.made = [], []
        self.current = RecordingStream("main", self.log)

    def stream(self, priority=0):
        self.made.append(priority)
        return RecordingStream(f"side{len(self.made)}", self.log)

    def current_stream(self):
        return self.current

    @contextlib.contextmanager
    def use_stream(self, stream):
        previous, self.current = self.current, stream
        self.log.append(f"enter {stream.name}")
        yield
        self.current = previous
        self.log.append(f"leave {stream.name}")


def test_side_stream_forks_after_the_current_stream_and_joins_back():
    services = RecordingServices()
    side = SideStream(services, services.stream(priority=-1))

    def work(x):
        services.log.append(f"work({x}) on {services.current_stream().name}")
        return x * 2

    forked = side.run(work, 21)
    assert services.log == ["side1 waits main", "enter side1", "work(21) on side1", "leave side1"]
    assert forked.join() == 42
    assert services.log[-1] == "main waits side1"
    side.run(work, 1).join()
    assert services.log[-5:] == ["side1 waits main", "enter side1", "work(1) on side1", "leave side1",
                                 "main waits side1"]  # the same stream again, forked after the join


def test_inline_runs_at_once():
    calls = []
    forked = INLINE.run(lambda x: calls.append(x) or x + 1, 4)
    assert calls == [4] and forked.join() == 5


def test_cpu_platform_has_no_side_stream_and_the_option_changes_nothing(golden_data):
    from omni.models.hunyuan_image3.config import HunyuanImage3Config
    from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer
    from omni.models.hunyuan_image3.checkpoint_names import load_state

    cpu = select("cpu")
    assert cpu.side_stream() is INLINE
    cfg = HunyuanImage3Config.from_json_dict(golden_data[0]["tiny_config"])
    outs = []
    for flag in (False, True):
        m = HunyuanImage3Transformer(cfg, cpu, BuildOptions(dtype=torch.float32, shared_expert_stream=flag))
        load_state(m, golden_data[2])
        m.finalize()
        assert m.model.layers[0].mlp.side is INLINE
        n = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            outs.append(m.model.layers[0].mlp(n, residual_TD=n))
    assert torch.equal(outs[0], outs[1])


def test_moe_resolves_callable_addends_right_before_its_combine():
    from omni.platforms.cuda.moe import CudaMoE, TorchKernels
    from omni.specs import MoESpec

    order = []

    class Recording(TorchKernels):
        def swiglu(self, h, quantize):
            order.append("swiglu")
            return super().swiglu(h, quantize)

        def combine(self, y, inverse_R, w, dtype, addends=()):
            order.append("combine")
            return super().combine(y, inverse_R, w, dtype, addends)

    E, k, D, inner, T = 4, 2, 32, 16, 9
    moe = CudaMoE(MoESpec(num_experts=E, topk=k, hidden=D, inner=inner, dtype=torch.bfloat16), Recording())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g).bfloat16()
    w, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(k, -1)
    prepared = moe.prepare_weights(torch.randn(E, 2 * inner, D, generator=g).bfloat16(),
                                   torch.randn(E, D, inner, generator=g).bfloat16())
    extra = (torch.randn(T, D, generator=g).bfloat16(),)
    without = moe(x, w, ids, prepared)
    order.clear()
    gemm2 = moe.gemm2
    moe.gemm2 = lambda *args: order.append("gemm2") or gemm2(*args)  # the routed path's last GEMM

    def late():
        order.append("addends")
        return extra

    got = moe(x, w, ids, prepared, addends=late)
    assert order == ["swiglu", "gemm2", "addends", "combine"]  # resolved once, after the last GEMM
    assert torch.equal(got, moe(x, w, ids, prepared, addends=extra))  # as the tuple gives
    assert not torch.equal(got, without)  # the addend was added


def _golden_layer(golden_data, **opts):
    from omni.models.hunyuan_image3.config import HunyuanImage3Config
    from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer
    from omni.models.hunyuan_image3.checkpoint_names import load_state

    cfg = HunyuanImage3Config.from_json_dict(golden_data[0]["tiny_config"])
    m = HunyuanImage3Transformer(cfg, select("cpu"), BuildOptions(dtype=torch.float32, **opts))
    load_state(m, golden_data[2])
    m.finalize()
    return m.model.layers[0].mlp, torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))


@torch.inference_mode()
def test_the_shared_expert_takes_the_side_stream_unless_a_plan_hooks_it(golden_data):
    services = RecordingServices()
    for hooked in (False, True):
        mlp, n = _golden_layer(golden_data)
        mlp.side = SideStream(services, services.stream())
        if hooked:  # as a parallel plan attaches an all-reduce to the shared expert's output projection
            mlp.shared_mlp.down_proj.register_forward_hook(lambda mod, args, out: out)
        services.log.clear()
        mlp(n, residual_TD=n)
        mlp(n, residual_TD=n)
        entered = [e for e in services.log if e.startswith("enter")]
        assert entered == ([] if hooked else [f"enter side{len(services.made)}"] * 2), (hooked, services.log)
