"""The wheel ships every Python package of the source tree: pyproject lists packages explicitly
(``kernels/`` installs as ``coda_cute.kernels``), so a new sub-package must be added there."""

import os

import pytest

tomllib = pytest.importorskip("tomllib")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source_packages(top: str, name: str) -> set[str]:
    out = set()
    for d, _, files in os.walk(os.path.join(ROOT, top)):
        if "__init__.py" in files:
            rel = os.path.relpath(d, os.path.join(ROOT, top))
            out.add(name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}")
    return out


def test_pyproject_lists_every_package():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        tool = tomllib.load(fh)["tool"]["setuptools"]
    assert tool["package-dir"]["coda_cute.kernels"] == "kernels"
    want = _source_packages("coda_cute", "coda_cute") | _source_packages("kernels", "coda_cute.kernels")
    assert set(tool["packages"]) == want
