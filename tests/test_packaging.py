"""pyproject.toml lists every package of the source tree: a wheel built from it (not an editable install,
which finds them all) then holds every module."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(ROOT / folder).parts]))
    assert found == set(tool["packages"])
