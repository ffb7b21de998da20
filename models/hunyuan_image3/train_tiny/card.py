"""Figures of the model card: the loss curves as a PNG (drawn with PIL; no plotting dependency).

    python -m omni.models.hunyuan_image3.train_tiny.card RUN_DIR OUT.png
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from PIL import Image, ImageDraw

W, H, PAD = 640, 260, 40
COLOURS = {"vae": (40, 80, 220), "dit": (220, 40, 40), "edit": (40, 150, 60)}


def _smooth(values: list[float], k: int = 20) -> list[float]:
    return [sum(values[max(0, i - k + 1): i + 1]) / len(values[max(0, i - k + 1): i + 1]) for i in range(len(values))]


def _panel(draw: ImageDraw.ImageDraw, x0: int, log: list, name: str, w: int) -> None:
    """One panel: log10(loss) against step, raw (light) and a 20-step running mean (dark)."""
    steps, losses = [s for s, *_ in log], [max(l, 1e-6) for _, l, *_ in log]
    lo, hi = math.log10(min(losses)), math.log10(max(losses))
    hi = hi if hi > lo else lo + 1

    def xy(s, l):
        return x0 + PAD + w * (s - steps[0]) / max(1, steps[-1] - steps[0]), \
            H - PAD - (H - 2 * PAD) * (math.log10(l) - lo) / (hi - lo)

    draw.rectangle([x0 + PAD, PAD, x0 + PAD + w, H - PAD], outline=(0, 0, 0))
    light = tuple(int(c + (255 - c) * 0.7) for c in COLOURS[name])
    draw.line([xy(s, l) for s, l in zip(steps, losses)], fill=light)
    draw.line([xy(s, l) for s, l in zip(steps, _smooth(losses))], fill=COLOURS[name], width=2)
    draw.text((x0 + PAD, 10), f"{name} loss (log scale) vs step", fill=(0, 0, 0))
    draw.text((x0 + PAD, H - PAD + 5), f"{steps[0]}", fill=(0, 0, 0))
    draw.text((x0 + PAD + w - 30, H - PAD + 5), f"{steps[-1]}", fill=(0, 0, 0))
    draw.text((x0 + 2, PAD), f"{10 ** hi:.3g}", fill=(0, 0, 0))
    draw.text((x0 + 2, H - PAD - 10), f"{10 ** lo:.3g}", fill=(0, 0, 0))


def plot_losses(run: Path, out: Path) -> Path:
    """One panel per part the run trained (vae, dit for the base run; edit for the Instruct run)."""
    parts = [p for p in COLOURS if (run / "state" / f"{p}.json").is_file()]
    if not parts:
        raise FileNotFoundError(f"{run / 'state'}: no loss log (vae.json, dit.json or edit.json)")
    img = Image.new("RGB", (W, H), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for i, part in enumerate(parts):
        log = json.loads((run / "state" / f"{part}.json").read_text())["log"]
        _panel(draw, i * W // len(parts), log, part, W // len(parts) - 2 * PAD)
    img.save(out)
    return out


if __name__ == "__main__":
    print(plot_losses(Path(sys.argv[1]), Path(sys.argv[2])))
