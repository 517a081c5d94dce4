"""The package's public surface: one namespace, documented; errors form one hierarchy."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import subprocess
import sys
from pathlib import Path

import kvtrio
import pytest
from kvtrio import errors


def test_every_public_error_is_a_kvtrio_error() -> None:
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), kvtrio.KvtrioError), name


def test_python_dash_m_prints_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "--help"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("usage: kvtrio")


def test_every_public_name_is_exported_listed_and_documented() -> None:
    """kvtrio re-exports its API through ``kvtrio`` (as trio does) and docs/api.md lists it."""
    api_doc = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    listed = dir(kvtrio)
    for name in kvtrio.__all__:
        value = getattr(kvtrio, name)
        assert name in listed, name
        assert f"`kvtrio.{name}`" in api_doc, f"docs/api.md does not list kvtrio.{name}"
        if name != "__version__":
            assert inspect.getdoc(value), f"kvtrio.{name} has no docstring"


@pytest.mark.parametrize("package", ["kvtrio.runtime", "kvtrio.actors", "kvtrio.storage",
                                     "kvtrio.metal"])
def test_subpackages_export_their_public_names(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__all__, package
    for name in module.__all__:
        value = getattr(module, name)
        assert name in dir(module), f"{package}.{name} not in dir()"
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), f"{package}.{name} has no docstring"


def test_import_kvtrio_stays_light() -> None:
    """``import kvtrio`` and ``kvtrio --help`` import neither MLX nor trio."""
    code = (
        "import sys, kvtrio\n"
        "from kvtrio.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in ('mlx', 'mlx.core', 'trio', 'mlx_lm') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match=r"^module 'kvtrio' has no attribute 'nope'$"):
        kvtrio.nope  # noqa: B018


def test_version_flag_prints_the_package_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"kvtrio {kvtrio.__version__}"
    assert kvtrio.__version__ == importlib.metadata.version("kvtrio")
