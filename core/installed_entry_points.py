"""The installed entry points of a group, read once per interpreter and ``sys.path``.

``importlib.metadata.entry_points`` reads the metadata of every installed
distribution on each call: about 9 ms in the test environment (27 ms under
cProfile), 124 calls to render the recipe docs once (four fifths of that render). Loading a recipe
asks for the model flavours and platforms each time, so a process that loads
recipes, flavours or platforms again asks the same question again.

The answer is kept per ``sys.path``: a folder added at run time (a plugin
written into a test's temporary folder, ``monkeypatch.syspath_prepend``) is
seen at once. A package installed into a folder already on the path while a
process runs is not; restart the process (servers and CLIs read plugins at
start anyway).
"""
from __future__ import annotations

import functools
import sys
from importlib.metadata import EntryPoint, entry_points


def of_group(group: str) -> tuple[EntryPoint, ...]:
    """The entry points under ``group`` that the current ``sys.path`` installs."""
    return _read(group, tuple(sys.path))


@functools.lru_cache(maxsize=64)
def _read(group: str, path: tuple[str, ...]) -> tuple[EntryPoint, ...]:
    return tuple(entry_points(group=group))
