"""Edit pairs for the tiny Instruct model: a one-object scene, an instruction, the edited scene.

Three edits, each changing one thing the quality gate can read
(``measure.read_image``): the object's colour ("make the circle green"),
the background ("make the background red") or the object's place ("move the
square to the left"). Source and target are drawn with the same jitter, so
nothing but the named property differs.

``EDIT_HELD`` lists (source scene, edit) pairs that training never shows:
``sample_edit`` rejects them (the instruction alone is seen, with other
sources, as it must be to be learnt). tests/test_quality_tiny_edit.py edits
exactly those sources with exactly those instructions.

Like ``data.batch``, ``edit_batch(seed, step, n)`` depends only on its
arguments, so a resumed run sees the same pairs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .data import ANCHORS, COLOURS, SHAPES, Obj, Scene, render

SIZE = 256  # the Instruct ratio table starts at base 256: a 16 x 16 latent grid
OPS = ("colour", "background", "move")
WORDS = ("make", "move", "to")
WHERE = {"left": "to the left", "right": "to the right", "top": "to the top", "bottom": "to the bottom",
         "centre": "to the centre"}

# (colour, shape, position, background, op, value): never a training pair; every op five times.
EDIT_HELD = (
    ("red", "circle", "left", "blue", "colour", "green"), ("green", "square", "right", "white", "colour", "yellow"),
    ("blue", "triangle", "top", "yellow", "colour", "red"), ("yellow", "circle", "bottom", "black", "colour", "white"),
    ("white", "square", "centre", "red", "colour", "blue"),
    ("black", "triangle", "left", "green", "background", "white"),
    ("red", "square", "top", "white", "background", "black"),
    ("green", "triangle", "bottom", "blue", "background", "yellow"),
    ("blue", "circle", "centre", "black", "background", "red"),
    ("yellow", "square", "left", "green", "background", "blue"),
    ("white", "triangle", "right", "blue", "move", "left"), ("black", "circle", "top", "yellow", "move", "bottom"),
    ("red", "triangle", "right", "black", "move", "centre"), ("green", "circle", "centre", "yellow", "move", "top"),
    ("blue", "square", "bottom", "white", "move", "right"),
)


@dataclass(frozen=True)
class Edit:
    source: Scene
    op: str  # one of OPS
    value: str  # the new colour (colour, background) or position (move)

    @property
    def obj(self) -> Obj:
        return self.source.objects[0]

    def instruction(self) -> str:
        if self.op == "colour":
            return f"make the {self.obj.shape} {self.value}"
        if self.op == "background":
            return f"make the background {self.value}"
        return f"move the {self.obj.shape} {WHERE[self.value]}"

    def target(self) -> Scene:
        o, bg = self.obj, self.source.background
        if self.op == "colour":
            return Scene((replace(o, colour=self.value),), bg)
        if self.op == "background":
            return Scene((o,), self.value)
        return Scene((replace(o, position=self.value),), bg)

    def expected(self) -> tuple[str, str, str]:
        """(object colour, position, background) the edited image must read as."""
        t = self.target()
        return t.objects[0].colour, t.objects[0].position, t.background

    def key(self) -> tuple[str, ...]:
        o = self.obj
        return (o.colour, o.shape, o.position, self.source.background, self.op, self.value)


def held_edit(colour: str, shape: str, position: str, background: str, op: str, value: str) -> Edit:
    return Edit(Scene((Obj(colour, shape, position),), background), op, value)


HELD_KEYS = frozenset(EDIT_HELD)


def sample_edit(rng: np.random.Generator) -> Edit:
    """One edit whose (source, instruction) pair is not held out; all colours in the target differ."""
    names = list(COLOURS)
    while True:
        colour, bg, new = (str(c) for c in rng.choice(names, size=3, replace=False))
        position = str(rng.choice(list(ANCHORS)))
        source = Scene((Obj(colour, str(rng.choice(SHAPES)), position),), bg)
        op = OPS[int(rng.integers(len(OPS)))]
        value = new if op != "move" else str(rng.choice([p for p in ANCHORS if p != position]))
        edit = Edit(source, op, value)
        if edit.key() not in HELD_KEYS:
            return edit


def render_pair(edit: Edit, rng: np.random.Generator | None, size: int = SIZE) -> tuple[np.ndarray, np.ndarray]:
    """(source, target) float32 ``[3, size, size]`` in [-1, 1], drawn with the same jitter."""
    state = None if rng is None else rng.bit_generator.state
    src = render(edit.source, rng, size)
    if rng is not None:
        rng.bit_generator.state = state
    return src, render(edit.target(), rng, size)


def edit_batch(seed: int, step: int, n: int, size: int = SIZE):
    """``n`` pairs: (sources ``[n, 3, S, S]``, targets ``[n, 3, S, S]``, instructions), from (seed, step) only."""
    rng = np.random.default_rng([seed, step, 17])
    edits = [sample_edit(rng) for _ in range(n)]
    pairs = [render_pair(e, rng, size) for e in edits]
    return np.stack([s for s, _ in pairs]), np.stack([t for _, t in pairs]), [e.instruction() for e in edits]


def to_uint8(x_3HW: np.ndarray) -> np.ndarray:
    """[-1, 1] ``[3, H, W]`` -> uint8 ``[H, W, 3]`` (what a user's PNG holds)."""
    return np.clip(np.round((x_3HW.transpose(1, 2, 0) + 1.0) * 127.5), 0, 255).astype(np.uint8)
