"""pyproject.toml declares the package the current way, so that installing it (make chat) prints no
setuptools warning of ours: a license as an SPDX string, and every folder the wheel carries files from,
data folders included, named as a package."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_license_is_an_spdx_string():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


def test_every_folder_inside_a_package_is_declared():
    """setuptools warns of a folder inside a package (its data, such as swiftspec/corpus) that the
    `packages` list leaves out; each one here is a package with its own package-data."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages, dirs = set(setuptools["packages"]), setuptools["package-dir"]

    def folder(package: str) -> Path:
        parent = max((name for name in dirs if package == name or package.startswith(name + ".")), key=len)
        return ROOT / dirs[parent] / Path(*package[len(parent):].split(".")[1:])

    found = set()
    for package in packages:
        for sub in folder(package).iterdir():
            if sub.is_dir() and sub.name != "__pycache__" and any(f.is_file() for f in sub.iterdir()):
                found.add(f"{package}.{sub.name}")
    assert found and found <= packages, found - packages
    for package, patterns in setuptools["package-data"].items():
        assert package in packages and all(any(folder(package).glob(p)) for p in patterns), package
