"""What an importer of the package relies on: the version, the typing marker, and dependency ranges
that the exact versions `make` installs (constraints.txt) satisfy."""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

import dsv41_jax

ROOT = Path(__file__).parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_matches_pyproject():
    assert dsv41_jax.__version__ == PROJECT["project"]["version"]


def test_py_typed_is_shipped():
    assert (Path(dsv41_jax.__file__).parent / "py.typed").is_file()
    assert "py.typed" in PROJECT["tool"]["setuptools"]["package-data"]["dsv41_jax"]


def test_constraints_pin_every_dependency_within_its_range():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version.strip()
    extras = PROJECT["project"]["optional-dependencies"]
    deps = PROJECT["project"]["dependencies"] + extras["dev"] + extras["serve"] + extras["mooncake"]
    for dep in map(Requirement, deps):
        name = dep.name.lower().replace("_", "-")
        if name == PROJECT["project"]["name"].lower().replace("_", "-"):  # dev's "dsv41_jax[serve]": checked above
            assert dep.extras <= set(extras), f"{dep} names an extra that pyproject.toml does not define"
            continue
        assert name in pins, f"{dep.name} has no exact version in constraints.txt"
        assert dep.specifier.contains(pins[name]), \
            f"constraints.txt pins {dep.name}=={pins[name]}, outside {dep.specifier}"
