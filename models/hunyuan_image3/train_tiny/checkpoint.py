"""Resume state and the exported checkpoint of a tiny training run (safetensors + JSON only).

``OUT/state/``, per part (``vae``, ``dit``): ``{part}.safetensors`` (the
module), ``{part}_optim.safetensors`` (AdamW moments per parameter name) and
``{part}.json`` (step, loss log). ``export`` writes the HF-layout
checkpoint the engine loads: config.json, two shards with
model.safetensors.index.json, tokenizer.json (``tiny._write_shards``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from .. import tiny


PARTS = {"vae": ("vae", "opt_vae", "vae_step"), "dit": ("model", "opt", "step"),  # module, optimizer, counter
         "edit": ("trainable", "opt", "step")}  # the Instruct run: transformer and ViT together


def save_state(tr, out: Path, part: str) -> None:
    """What ``load_state`` needs to continue ``part`` (vae | dit) exactly; each file is written then renamed.

    The two parts are independent (the transformer trains on the pinned
    latents, not on the VAE), so they may train at the same time in two
    processes sharing ``out``.
    """
    module_attr, opt_attr, counter = PARTS[part]
    module, opt = getattr(tr, module_attr), getattr(tr, opt_attr)
    root = out / "state"
    root.mkdir(parents=True, exist_ok=True)
    moments = {}
    for name, param in module.named_parameters():
        for key, value in opt.state.get(param, {}).items():
            moments[f"{name}::{key}"] = value.detach().cpu().contiguous()
    weights = {k: v.cpu().contiguous() for k, v in module.state_dict().items()}
    _atomic(root / f"{part}.safetensors", lambda p: save_file(weights, str(p)))
    _atomic(root / f"{part}_optim.safetensors", lambda p: save_file(moments, str(p)))
    meta = {"step": getattr(tr, counter), "log": tr.log[part]}
    _atomic(root / f"{part}.json", lambda p: p.write_text(json.dumps(meta)))


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)


def load_state(tr, out: Path) -> list[str]:
    """Restore every saved part of the trainer's ``PARTS`` into it; returns the parts found."""
    found = []
    for part in tr.PARTS:
        root, (module_attr, opt_attr, counter) = out / "state", PARTS[part]
        if not (root / f"{part}.json").is_file():
            continue
        module, opt = getattr(tr, module_attr), getattr(tr, opt_attr)
        module.load_state_dict(load_file(str(root / f"{part}.safetensors")))
        moments = load_file(str(root / f"{part}_optim.safetensors"))
        for name, param in module.named_parameters():
            state = {k.split("::")[1]: v.to(param.device) if v.dim() else v  # AdamW keeps its step on the CPU
                     for k, v in moments.items() if k.split("::")[0] == name}
            if state:
                opt.state[param] = state
        meta = json.loads((root / f"{part}.json").read_text())
        setattr(tr, counter, meta["step"])
        tr.log[part] = meta["log"]
        found.append(part)
    return found


def export(tr, dest: Path) -> Path:
    """The trained checkpoint in the real HF layout (what ``build_pipeline`` loads)."""
    config = {**tr.config, "vae": {**tr.config["vae"], "scaling_factor": tr.scale}}
    tr.model.requires_grad_(False)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = tiny.official_tensors({"": tr.model, "vae.": tr.vae})
    if getattr(tr, "vision", None) is not None:  # the ViT's own names are the official ones
        tensors.update(tr.vision.state_dict())
    tiny._write_shards(tmp, {k: v.detach().cpu() for k, v in tensors.items()})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tr.tok._backend.save(str(tmp / "tokenizer.json"), pretty=True)
    for keep in ("README.md", "loss.png", "first_image.png"):  # the model card and its figures stay
        if (dest / keep).is_file():
            shutil.copy(dest / keep, tmp / keep)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest
