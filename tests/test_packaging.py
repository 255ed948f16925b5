"""The wheel holds every package: a folder of Python modules missing from pyproject's list is left out of a
non-editable install (the container image) and its import fails there, while every editable checkout works."""

import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_folder_of_modules_is_a_listed_package():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join([top, *module.parent.relative_to(ROOT / path).parts])
             for top, path in setuptools["package-dir"].items()
             for module in (ROOT / path).rglob("*.py") if "__pycache__" not in module.parts}
    missing = sorted(found - set(setuptools["packages"]))
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
