"""The synthetic data set: coloured shapes at named positions on coloured backgrounds, with template captions.

Everything is drawn on the fly from a seed: ``batch(seed, step, n)`` depends
only on its arguments, so a resumed run sees the same data as an unbroken
one. ``HELD_OUT`` lists (colour, shape, position, background) tuples that no
training caption ever shows, in any template, alone or as one of two objects;
the quality test (tests/test_quality_tiny.py) prompts with exactly those.

Images are float32 ``[3, S, S]`` in [-1, 1] (the VAE's range); positions are
anchors in [0, 1] x [0, 1] (x right, y down).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SIZE = 128  # native size of the tiny model: 8 x 8 latent tokens (the shared 2-core CPU sets the budget)
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
           "yellow": (240, 200, 30), "white": (245, 245, 245), "black": (25, 25, 25)}
SHAPES = ("circle", "square", "triangle")
ANCHORS = {"left": (0.25, 0.5), "right": (0.75, 0.5), "top": (0.5, 0.25), "bottom": (0.5, 0.75),
           "centre": (0.5, 0.5)}
PHRASES = {"left": ("on the left",), "right": ("on the right",), "top": ("at the top",),
           "bottom": ("at the bottom",), "centre": ("in the centre", "in the center")}
TEMPLATES = ("a {obj} on a {bg} background", "{obj} {bg} background", "a {bg} background with a {obj}")
TWO_TEMPLATE = "a {obj} and a {obj2} on a {bg} background"
HELD_TEMPLATE = TEMPLATES[0]  # the held prompts use the first template with the first phrase
TWO_OBJECTS_P = 0.25

# (colour, shape, position, background): never in training; every colour, shape, position and background occurs.
HELD_OUT = (
    ("red", "circle", "left", "blue"), ("green", "square", "right", "white"), ("blue", "triangle", "top", "yellow"),
    ("yellow", "circle", "bottom", "black"), ("white", "square", "centre", "red"),
    ("black", "triangle", "left", "green"), ("red", "square", "top", "white"),
    ("green", "triangle", "bottom", "blue"), ("blue", "circle", "centre", "black"),
    ("yellow", "square", "left", "green"), ("white", "triangle", "right", "blue"),
    ("black", "circle", "top", "yellow"), ("red", "triangle", "right", "black"),
    ("green", "circle", "centre", "yellow"), ("blue", "square", "bottom", "white"),
    ("yellow", "triangle", "top", "red"), ("white", "circle", "bottom", "green"),
    ("black", "square", "right", "red"), ("red", "circle", "centre", "white"), ("blue", "triangle", "left", "black"),
)
WORDS = ("a", "on", "the", "at", "in", "with", "and", "background", "center", *COLOURS, *SHAPES, *ANCHORS)


@dataclass(frozen=True)
class Obj:
    colour: str
    shape: str
    position: str


@dataclass(frozen=True)
class Scene:
    objects: tuple[Obj, ...]
    background: str


def phrase(o: Obj, k: int = 0) -> str:
    options = PHRASES[o.position]
    return f"{o.colour} {o.shape} {options[k % len(options)]}"


def caption(scene: Scene, template: int = 0, variant: int = 0) -> str:
    """The caption of ``scene``: ``template`` picks a one-object template, ``variant`` the centre spelling."""
    objs = [phrase(o, variant) for o in scene.objects]
    if len(objs) == 2:
        return TWO_TEMPLATE.format(obj=objs[0], obj2=objs[1], bg=scene.background)
    return TEMPLATES[template % len(TEMPLATES)].format(obj=objs[0], bg=scene.background)


def held_prompt(colour: str, shape: str, position: str, background: str) -> str:
    return caption(Scene((Obj(colour, shape, position),), background), 0, 0)


def is_held(scene: Scene) -> bool:
    return any((o.colour, o.shape, o.position, scene.background) in HELD_OUT for o in scene.objects)


def sample_scene(rng: np.random.Generator) -> Scene:
    """One scene that no held-out tuple appears in (rejection sampling)."""
    names = list(COLOURS)
    while True:
        n = 2 if rng.random() < TWO_OBJECTS_P else 1
        positions = rng.choice(list(ANCHORS), size=n, replace=False)
        colours = rng.choice(names, size=n + 1, replace=False)  # objects and background all differ
        objs = tuple(Obj(str(c), str(rng.choice(SHAPES)), str(p)) for c, p in zip(colours[:n], positions))
        scene = Scene(objs, str(colours[n]))
        if not is_held(scene):
            return scene


def _mask(shape: str, cx: float, cy: float, r: float, yy: np.ndarray, xx: np.ndarray) -> np.ndarray:
    """Boolean mask of one shape of half-size ``r`` centred at (cx, cy), all in pixels."""
    if shape == "circle":
        return (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
    if shape == "square":
        return (abs(xx - cx) <= r) & (abs(yy - cy) <= r)
    # upright triangle: apex at top, base at the bottom, same bounding box as the square
    top, bottom = cy - r, cy + r
    half_w = r * (yy - top) / (2 * r)
    return (yy >= top) & (yy <= bottom) & (abs(xx - cx) <= half_w)


def render(scene: Scene, rng: np.random.Generator | None = None, size: int = SIZE) -> np.ndarray:
    """float32 ``[3, size, size]`` in [-1, 1]; ``rng`` jitters positions and sizes (None: the anchors exactly)."""
    img = np.empty((size, size, 3), dtype=np.float32)
    img[:] = COLOURS[scene.background]
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    two = len(scene.objects) == 2
    for o in scene.objects:
        ax, ay = ANCHORS[o.position]
        jx, jy, jr = (rng.uniform(-0.04, 0.04, 3) if rng is not None else (0.0, 0.0, 0.0))
        r = (0.14 if two else 0.2) + 0.25 * jr
        img[_mask(o.shape, (ax + jx) * size, (ay + jy) * size, r * size, yy, xx)] = COLOURS[o.colour]
    return (img / 127.5 - 1.0).transpose(2, 0, 1).copy()


def batch(seed: int, step: int, n: int, size: int = SIZE) -> tuple[np.ndarray, list[str]]:
    """``n`` images ``[n, 3, size, size]`` and captions, a function of (seed, step) only."""
    rng = np.random.default_rng([seed, step])
    scenes = [sample_scene(rng) for _ in range(n)]
    captions = [caption(s, int(rng.integers(len(TEMPLATES))), int(rng.integers(2))) for s in scenes]
    return np.stack([render(s, rng, size) for s in scenes]), captions
