"""pyproject.toml declares ranges (installable next to a CUDA or NGC torch); the constraints files hold the pins."""

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
RANGED = ("torch", "megatron-core", "torchdata")


def dependencies() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(line) for line in project["dependencies"]]
    return {canonicalize_name(r.name): r for r in reqs}


def pins(path: Path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    reqs = [Requirement(line) for line in lines if line]
    for req in reqs:
        assert [s.operator for s in req.specifier] == ["=="], f"{path.name}: {req} is not an exact pin"
    return {canonicalize_name(r.name): next(iter(r.specifier)).version for r in reqs}


@pytest.mark.parametrize("name", RANGED)
def test_core_dependencies_are_ranges_not_pins(name):
    req = dependencies()[name]
    assert req.specifier, f"{name} has no version range"
    assert not any(s.operator in ("==", "===") for s in req.specifier), f"{name} is pinned: {req}"


def test_ranges_accept_the_ci_versions_and_a_container_torch():
    deps = dependencies()
    assert deps["torch"].specifier.contains("2.13.0+cpu") and deps["torch"].specifier.contains("2.6.0")
    # an NGC container's torch; pip treats an installed pre-release as satisfying (prereleases=True)
    assert deps["torch"].specifier.contains("2.8.0a0+5228986c39.nv25.06", prereleases=True)
    assert deps["megatron-core"].specifier.contains("0.16.1") and not deps["megatron-core"].specifier.contains("0.17.0")
    assert deps["torchdata"].specifier.contains("0.11.0") and not deps["torchdata"].specifier.contains("0.12.0")


def test_constraints_pin_the_ci_versions():
    cpu = pins(ROOT / "requirements" / "constraints-cpu.txt")
    cuda = pins(ROOT / "requirements" / "constraints-cuda.txt")
    assert cpu["torch"] == "2.13.0+cpu" and cuda["torch"] == "2.13.0"
    assert cpu["megatron-core"] == "0.16.1" and cpu["torchdata"] == "0.11.0"
    assert {k: v for k, v in cpu.items() if k != "torch"} == {k: v for k, v in cuda.items() if k != "torch"}
    assert "transformer-engine" not in cuda
    for name, req in dependencies().items():            # every declared range admits the pinned version
        assert req.specifier.contains(cpu[name], prereleases=True), f"{name}=={cpu[name]} outside {req}"
