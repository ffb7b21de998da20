"""The image heads' 3x3 convolutions: cuDNN's direct kernel against Winograd F(2x2, 3x3) (the cuda glue's
``conv3x3``), in the same run, at the released shapes (random values, bf16, channels-last as the model keeps
them on cuda).

1. Each convolution of one 1024x1024 CFG step (``patch_embed`` on one latent, ``final_layer`` on both rows; a
   64x64 grid): cuDNN, Winograd with fp32 GEMM results (the kernel's), Winograd with bf16 GEMM results; each
   also split into its three launches. Error of each against an fp64 convolution of the same bf16 values
   (relative L2 and largest difference in bf16 ulps of the reference's scale).
2. The whole heads of one step (``bench_group_norm.heads``, NHWC weights, the glue's GroupNorm kernel): torch
   convolutions against the glue's ``conv3x3`` (time, and the relative L2 distance of the outputs).

3. ``--launches 32x64x8,16x64x4``: the same convolutions, transforms and heads with each other launch shape of the
   two transforms (tiles x channels x warps a program; ``winograd_triton.Launch``), against the shipped one in
   the same rounds, and whether their outputs equal the shipped launch's bit for bit.

Each figure is a CUDA-event median; the variants alternate in rounds (``bench_common.round_robin``).

    python bench/bench_winograd.py --json out.json
    python bench/bench_winograd.py --launches 32x64x8,16x64x4,32x32x4 --json out.json
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit, relative, round_robin  # noqa: E402
from bench_group_norm import heads  # noqa: E402

from omni.group_norm import use_group_norm_kernel  # noqa: E402
from omni.models.hunyuan_image3 import image_io  # noqa: E402
from omni.platform_manager import select  # noqa: E402
from omni.specs import GlueSpec  # noqa: E402
from omni.winograd import use_conv3x3_kernel, winograd_weights  # noqa: E402

# (name, rows, in, out): the 3x3 convolutions of one step on a 64x64 latent grid
SHAPES = (("patch_embed in_layers 1024->4096", 1, 1024, 4096),
          ("patch_embed out_layers 4096->4096", 1, 4096, 4096),
          ("final_layer in_layers 4096->1024", 2, 4096, 1024),
          ("final_layer out_layers 1024->1024", 2, 1024, 1024))


@contextmanager
def shipped_launch(wt, launch):
    """``wt.LAUNCH`` (what the glue's ``conv3x3`` takes) set to ``launch`` for the block."""
    shipped, wt.LAUNCH = wt.LAUNCH, launch
    try:
        yield
    finally:
        wt.LAUNCH = shipped


def with_launch(wt, launch, fn):
    def run():
        with shipped_launch(wt, launch):
            return fn()
    return run


def launch_variants(wt, fns: dict, launches, names) -> dict:
    """``fns`` plus, for each of ``launches``, the ``names`` among them run with that launch shape (``name@RxCxW``)."""
    out = dict(fns)
    for launch in launches:
        out |= {f"{n}@{'x'.join(map(str, launch))}": with_launch(wt, launch, fns[n]) for n in names}
    return out


def conv_case(wt, rows: int, c_in: int, c_out: int, grid: int, rounds: int, launches=()) -> dict:
    g = torch.Generator(device="cuda").manual_seed(c_in + c_out)
    x = torch.randn(rows, c_in, grid, grid, device="cuda", generator=g).bfloat16()
    x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.randn(c_out, c_in, 3, 3, device="cuda", generator=g) / (3 * c_in ** 0.5)).bfloat16()
    b = torch.randn(c_out, device="cuda", generator=g).bfloat16()
    w_cl, u = w.contiguous(memory_format=torch.channels_last), winograd_weights(w, torch.bfloat16)
    v = wt.input_transform(x)
    m = torch.bmm(v, u.transpose(1, 2), out_dtype=torch.float32)
    fns = {
        "cudnn": lambda: F.conv2d(x, w_cl, b, padding=1),
        "winograd_fp32_m": lambda: wt.conv3x3(x, u, b),
        "winograd_bf16_m": lambda: wt.conv3x3(x, u, b, m_dtype=torch.bfloat16),
        "part_input_transform": lambda: wt.input_transform(x),
        "part_gemms_fp32_out": lambda: torch.bmm(v, u.transpose(1, 2), out_dtype=torch.float32),
        "part_output_transform": lambda: wt.output_transform(m, b, None, (rows, c_out, grid, grid), x.dtype),
    }
    fns = launch_variants(wt, fns, launches, ("winograd_fp32_m", "part_input_transform", "part_output_transform"))
    t = round_robin(fns, rounds)
    ref = F.conv2d(x.double(), w.double(), b.double(), padding=1)
    scale = float(ref.abs().max())
    outs = {k: fns[k]() for k in ("cudnn", "winograd_fp32_m", "winograd_bf16_m")}
    flops = 2 * rows * grid * grid * 9 * c_in * c_out
    same = {k: bool(torch.equal(f(), outs["winograd_fp32_m"])) for k, f in fns.items()
            if k.startswith("winograd_fp32_m@")}
    return {"ms": {k: v_ * 1e3 for k, v_ in t.items()}, "equal_to_shipped_launch": same,
            "tflops_cudnn": flops / t["cudnn"] / 1e12,
            "speedup_fp32_m": t["cudnn"] / t["winograd_fp32_m"],
            "speedup_bf16_m": t["cudnn"] / t["winograd_bf16_m"],
            "rel_l2_vs_fp64": {k: relative(o, ref) for k, o in outs.items()},
            "max_abs_vs_fp64_over_max_ref": {k: float((o.double() - ref).abs().max()) / scale
                                             for k, o in outs.items()}}


def heads_case(platform, rounds: int, launches=()) -> dict:
    glue = platform.glue(GlueSpec(hidden=4096, head_dim=128, eps=1e-5, dtype=torch.bfloat16))

    def prepare(conv: bool):
        def run(down, up):
            image_io.to_channels_last(down, up)
            use_group_norm_kernel(glue.group_norm, down, up)
            if conv:
                use_conv3x3_kernel(glue, down, up)
        return run

    from omni.platforms.cuda import winograd_triton as wt

    steps = {"torch_conv": heads(platform, prepare(False)), "winograd_conv": heads(platform, prepare(True))}
    steps = launch_variants(wt, steps, launches, ("winograd_conv",))
    t = round_robin(steps, rounds)
    outs = {k: f() for k, f in steps.items()}
    return {"ms": {k: s * 1e3 for k, s in t.items()}, "speedup": t["torch_conv"] / t["winograd_conv"],
            "rel_l2_winograd_vs_torch": relative(outs["winograd_conv"], outs["torch_conv"].double()),
            "equal_to_shipped_launch": {k: bool(torch.equal(o, outs["winograd_conv"])) for k, o in outs.items()
                                        if k.startswith("winograd_conv@")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", type=int, default=64, help="latent grid side (64: a 1024x1024 image)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--launches", default="", help="other launch shapes of the transforms to time, comma-separated "
                                                  "rows x channels x warps (e.g. 32x64x8,16x64x4)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    platform = select("cuda")
    platform.device_services(0)
    from omni.platforms.cuda import winograd_triton as wt
    try:
        launches = [wt.Launch.parse(v) for v in a.launches.split(",") if v]
    except ValueError as e:
        p.error(f"--launches: {e}")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit(),
           "grid": a.grid, "shipped_launch": list(wt.LAUNCH), "convs": {}}
    with torch.inference_mode():
        for name, rows, c_in, c_out in SHAPES:
            out["convs"][name] = conv_case(wt, rows, c_in, c_out, a.grid, a.rounds, launches)
            print(name, out["convs"][name]["ms"], flush=True)
        out["heads"] = heads_case(platform, a.rounds, launches)
    return emit(out, a.json)


if __name__ == "__main__":
    sys.exit(main())
