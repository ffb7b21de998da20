"""Entry points read once per ``sys.path`` (``omni.installed_entry_points``), with a real installed-looking
distribution in a temporary folder."""
from __future__ import annotations

from pathlib import Path

from omni import installed_entry_points, model_registry


def plugin_folder(root: Path) -> Path:
    """A folder holding a distribution that registers the model flavour ``probe_flavor``."""
    info = root / "probe_flavor-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: probe-flavor\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[omni.models]\nprobe_flavor = probe_flavor_mod:flavor\n")
    return root


def test_the_metadata_is_read_once_until_the_path_changes(tmp_path, monkeypatch):
    reads: list[str] = []
    real = installed_entry_points.entry_points
    monkeypatch.setattr(installed_entry_points, "entry_points", lambda group: reads.append(group) or real(group=group))
    installed_entry_points._read.cache_clear()
    first = installed_entry_points.of_group("omni.models")
    assert installed_entry_points.of_group("omni.models") == first and reads == ["omni.models"]
    assert "hunyuan_image3_tiny" in {ep.name for ep in first}

    monkeypatch.syspath_prepend(str(plugin_folder(tmp_path / "site")))
    assert "probe_flavor" in model_registry.names() and len(reads) == 2  # a new path is read again
    assert "probe_flavor" in model_registry.names() and len(reads) == 2
