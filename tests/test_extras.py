"""Every third-party module omni_stream imports is declared where a fresh install gets it.

CI installs the README's extras into a Python that already holds other
packages, so a module that one of them brought along passes CI and fails
on a fresh clone: scipy, which the lms samplers need, was declared nowhere
(issue #34). A fresh virtual environment on every CI run does not fit CI's
time budget; this checks the declarations instead. :data:`SOURCES` says,
for each third-party module, which feature needs it and so which extra of
pyproject.toml (or the base dependencies) must install it; the tests check
that the map covers every module the code imports (statically, and the
packages samplers import by name) and that pyproject.toml declares each one
where the map says.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import omni_stream

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(omni_stream.__file__).resolve().parent

#: module -> (the extra that installs it, "" for the base dependencies; its distribution).
SOURCES: dict[str, tuple[str, str]] = {
    # The engine, the server, previews and the embedded models.
    "torch": ("", "torch"),
    "numpy": ("", "numpy"),  # the embedded models' images, preview decoding, checkpoints
    "anyio": ("", "anyio"),
    "typing_extensions": ("", "typing_extensions"),  # engine/options.py before Python 3.11; Unpack for types
    "uvloop": ("", "uvloop"),
    "websockets": ("", "websockets"),
    "starlette": ("", "starlette"),
    "uvicorn": ("", "uvicorn"),
    "PIL": ("", "pillow"),
    "simplejpeg": ("", "simplejpeg"),
    "prometheus_client": ("", "prometheus-client"),
    # Diffusers pipelines (models/diffusers/), and the lms samplers' integrals.
    "diffusers": ("diffusers", "diffusers"),
    "scipy": ("diffusers", "scipy"),
    "safetensors": ("diffusers", "safetensors"),  # a single-file checkpoint's header
    "huggingface_hub": ("diffusers", "huggingface_hub"),  # the hub cache's config folders
    # MP4 results and previews.
    "av": ("video", "av"),
    # Ray Serve replicas (integrations/ray_serve/).
    "ray": ("ray", "ray"),
    # The server under trio.
    "trio": ("trio", "trio"),
    "hypercorn": ("trio", "hypercorn"),
    # Signed webhooks.
    "httpx": ("webhooks", "httpx"),
    "standardwebhooks": ("webhooks", "standardwebhooks"),
}

#: Modules a feature imports that no extra installs, each with the feature: a
#: request for it is refused naming the pip command (samplers.check_installed).
UNDECLARED: dict[str, str] = {"torchsde": "the dpmpp_sde samplers"}


def imported_modules() -> dict[str, set[str]]:
    """Top-level third-party modules imported anywhere in the package (functions too) -> files."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top != PACKAGE.name:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def sampler_packages() -> dict[str, set[str]]:
    """Packages the diffusers samplers import by name (Sampler.needs) -> the samplers."""
    from omni_stream.models.diffusers import samplers

    found: dict[str, set[str]] = {}
    for sampler in (*samplers.NOISE, *samplers.FLOW):
        for package in sampler.needs:
            found.setdefault(package, set()).add(sampler.name)
    return found


def declared() -> dict[str, set[str]]:
    """pyproject.toml's distributions by extra ("" the base dependencies), as a fresh clone installs them."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    return {extra: {canonicalize_name(Requirement(r).name) for r in reqs} for extra, reqs in groups.items()}


def test_every_third_party_module_the_package_imports_has_a_source() -> None:
    used = {**imported_modules(), **sampler_packages()}
    known = {**SOURCES, **UNDECLARED}
    unknown = {module: sorted(where) for module, where in used.items() if module not in known}
    assert not unknown, f"say in SOURCES which extra installs each of these (and declare it there): {unknown}"
    # And the map holds nothing the code no longer imports.
    assert sorted(set(SOURCES) | set(UNDECLARED)) == sorted(used)


@pytest.mark.parametrize("extra", sorted({extra for extra, _ in SOURCES.values()}), ids=lambda e: e or "base")
def test_each_extra_declares_the_modules_its_features_import(extra: str) -> None:
    groups = declared()
    assert extra in groups, f"pyproject.toml has no extra {extra!r}"
    missing = {
        module: distribution for module, (source, distribution) in SOURCES.items()
        if source == extra and canonicalize_name(distribution) not in groups[extra]
    }
    where = f"the {extra!r} extra" if extra else "[project].dependencies"
    assert not missing, f"{where} in pyproject.toml does not declare {missing} (module: distribution)"


def test_the_sources_name_the_distributions_that_install_those_modules() -> None:
    # Checked where a module is installed: "PIL" comes from pillow, not "PIL".
    installed = importlib.metadata.packages_distributions()
    for module, (_, distribution) in SOURCES.items():
        if module in installed:
            names = {canonicalize_name(d) for d in installed[module]}
            assert canonicalize_name(distribution) in names, (module, installed[module])


def test_a_refused_samplers_error_names_the_extra_that_declares_its_package() -> None:
    from omni_stream.models.diffusers import samplers

    for package, extra in samplers.EXTRAS.items():
        assert SOURCES[package][0] == extra, package
    assert set(sampler_packages()) == set(samplers.EXTRAS) | set(UNDECLARED)
