"""Command line of the tiny training run.

    python -m omni.models.hunyuan_image3.train_tiny --out runs/tiny --seed 0          # vae, dit, export (the shipped run)
    python -m omni.models.hunyuan_image3.train_tiny --out runs/tiny --phase dit --resume   # continue one part

Phases: ``vae`` trains the VAE for ``--vae-steps``; ``dit`` the transformer for
``--steps`` (on the pinned latents, so it needs no trained VAE and the two
may run at once in two processes); ``export`` writes OUT/checkpoint from the
saved states; ``all`` runs the three in turn. Loss lines go to stdout (and
OUT/state/*.json). The data of step s is a function of (seed, s) only.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .checkpoint import export, load_state, save_state
from .train import Trainer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m omni.models.hunyuan_image3.train_tiny", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="run directory (state/, checkpoint/)")
    p.add_argument("--phase", choices=("all", "vae", "dit", "export"), default="all", help="default all")
    p.add_argument("--seed", type=int, default=0, help="data, noise and init seed (default 0)")
    p.add_argument("--steps", type=int, default=1200, help="transformer steps (default 1200: the shipped run)")
    p.add_argument("--vae-steps", type=int, default=1380, help="VAE steps (default 1380: the shipped run)")
    p.add_argument("--batch", type=int, default=16, help="transformer rows per step (default 16)")
    p.add_argument("--vae-batch", type=int, default=4, help="VAE images per step (default 4)")
    p.add_argument("--vae-size", type=int, default=64, help="side of the VAE's training crops (default 64)")
    p.add_argument("--lr", type=float, default=1e-3, help="transformer peak learning rate (default 1e-3)")
    p.add_argument("--vae-lr", type=float, default=2e-3, help="VAE learning rate (default 2e-3)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--save-every", type=int, default=20, help="steps between resume states (default 20)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/state")
    return p.parse_args(argv)


def _run(tr: Trainer, part: str, total: int, args) -> None:
    attr, fn = ("vae_step", tr.train_vae_step) if part == "vae" else ("step", tr.train_step)
    t0, start = time.time(), getattr(tr, attr)
    while getattr(tr, attr) < total:
        loss = fn()
        step = getattr(tr, attr)
        tr.log[part].append([step, loss, round(time.time() - t0, 1)])
        print(f"{part} step {step}/{total} loss {loss:.5f} ({time.time() - t0:.0f} s)", flush=True)
        if step % args.save_every == 0 or step == total:
            save_state(tr, args.out, part)
    print(f"{part}: {getattr(tr, attr) - start} steps in {time.time() - t0:.0f} s", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tr = Trainer(args)
    if args.resume or args.phase == "export":
        print(f"resumed {load_state(tr, args.out)}: vae step {tr.vae_step}, transformer step {tr.step}", flush=True)
    if args.phase in ("all", "vae"):
        _run(tr, "vae", args.vae_steps, args)
    if args.phase in ("all", "dit"):
        tr.vae.requires_grad_(False)
        _run(tr, "dit", args.steps, args)
    if args.phase in ("all", "export"):
        print(f"checkpoint: {export(tr, args.out / 'checkpoint')}", flush=True)


if __name__ == "__main__":
    main()
