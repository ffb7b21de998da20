"""Command line of the tiny training run.

    python -m omni.models.hunyuan_image3.train_tiny --out runs/tiny --seed 0        # vae, dit, export (the shipped run)
    python -m omni.models.hunyuan_image3.train_tiny --out runs/tiny --phase dit --resume   # continue one part
    python -m omni.models.hunyuan_image3.train_tiny --model instruct --out runs/edit --device cuda  # the Instruct run

Phases: ``vae`` trains the VAE for ``--vae-steps``; ``dit`` the transformer for
``--steps`` (on the pinned latents, so it needs no trained VAE and the two
may run at once in two processes); ``export`` writes OUT/checkpoint from the
saved states; ``all`` runs the three in turn. ``--model instruct`` trains the
tiny Instruct model on edit pairs from the shipped base checkpoint
(``instruct.py``): its ``dit`` phase is that run, there is no VAE phase. Loss lines go to stdout (and
OUT/state/*.json). The data of step s is a function of (seed, s) only.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .checkpoint import export, load_state, save_state
from .train import Trainer

STEPS = {"base": 1200, "instruct": 3400}  # the shipped runs (schedule: SCHEDULE)
SCHEDULE = {"base": 1200, "instruct": 2000}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m omni.models.hunyuan_image3.train_tiny", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="run directory (state/, checkpoint/)")
    p.add_argument("--phase", choices=("all", "vae", "dit", "export"), default="all", help="default all")
    p.add_argument("--seed", type=int, default=0, help="data, noise and init seed (default 0)")
    p.add_argument("--model", choices=("base", "instruct"), default="base",
                   help="base: the text-to-image default; instruct: the editing model (default base)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"transformer steps (default: the shipped runs, base {STEPS['base']}, "
                        f"instruct {STEPS['instruct']})")
    p.add_argument("--vae-steps", type=int, default=1380, help="VAE steps (default 1380: the shipped run)")
    p.add_argument("--schedule-steps", type=int, default=None,
                   help="length of the cosine learning-rate decay (default: the shipped run's without --steps, else "
                        "--steps); steps past it run at the floor rate, 0.1 x --lr")
    p.add_argument("--batch", type=int, default=None, help="transformer rows per step (default: base 16, instruct 32)")
    p.add_argument("--vae-batch", type=int, default=4, help="VAE images per step (default 4)")
    p.add_argument("--vae-size", type=int, default=64, help="side of the VAE's training crops (default 64)")
    p.add_argument("--lr", type=float, default=1e-3, help="transformer peak learning rate (default 1e-3)")
    p.add_argument("--vae-lr", type=float, default=2e-3, help="VAE learning rate (default 2e-3)")
    p.add_argument("--group", type=int, default=4, help="rows per packed forward (default 4)")
    p.add_argument("--device", default="cpu", help="torch device to train on (default cpu; e.g. cuda)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--save-every", type=int, default=20, help="steps between resume states (default 20)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/state")
    args = p.parse_args(argv)
    args.batch = args.batch or {"base": 16, "instruct": 32}[args.model]
    shipped = args.steps is None
    args.steps = STEPS[args.model] if shipped else args.steps
    if args.schedule_steps is None:
        args.schedule_steps = SCHEDULE[args.model] if shipped else args.steps
    return args


def _run(tr, part: str, total: int, args) -> None:
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
    if args.model == "instruct":
        from .instruct import InstructTrainer

        tr, dit = InstructTrainer(args), "edit"
        if args.phase == "vae":
            raise SystemExit("--model instruct has no vae phase: it keeps the base checkpoint's VAE")
    else:
        tr, dit = Trainer(args), "dit"
    if args.resume or args.phase == "export":
        found = load_state(tr, args.out)
        print(f"resumed {found}: vae step {getattr(tr, 'vae_step', '-')}, transformer step {tr.step}", flush=True)
    if args.phase in ("all", "vae") and args.model == "base":
        _run(tr, "vae", args.vae_steps, args)
    if args.phase in ("all", "dit"):
        tr.vae.requires_grad_(False)
        _run(tr, dit, args.steps, args)
    if args.phase in ("all", "export"):
        print(f"checkpoint: {export(tr, args.out / 'checkpoint')}", flush=True)


if __name__ == "__main__":
    main()
