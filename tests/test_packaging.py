"""Every Python package folder under the mapped top-level folders is listed in pyproject.toml.

An editable install finds unlisted subpackages through the source tree, so only a plain
``pip install .`` would miss one: this test catches it without building a wheel.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapping = cfg["package-dir"]
    assert set(mapping) == listed, "package-dir and packages must name the same packages"
    # Top-level mappings are the roots; walk each for __init__.py folders.
    roots = {name: ROOT / folder for name, folder in mapping.items() if name.count(".") <= 1}
    missing = []
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            if "__pycache__" in rel.parts:
                continue
            pkg = ".".join([name, *rel.parts]) if rel.parts else name
            if pkg not in listed:
                missing.append(f"{pkg} ({init.parent.relative_to(ROOT)})")
    assert not missing, f"add to [tool.setuptools] packages and package-dir: {missing}"
