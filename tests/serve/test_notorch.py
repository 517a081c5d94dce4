"""docs/serve.md, "Start": ``kvtrio serve`` keeps an installed PyTorch out of its process
(mlx-lm does not use it; transformers imports it at start wherever it is installed), unless
``--import-torch`` or ``--trust-remote-code`` is given.

Each test installs a stand-in ``torch`` (a package and its dist-info, version 2.9.0, as
transformers checks) on PYTHONPATH whose import leaves a mark, and runs the command line
in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

STAND_IN = """\
import os
open(os.environ["TORCH_MARK"], "a").write("imported\\n")
__version__ = "2.9.0"
"""


def _stand_in_torch(root: Path) -> dict[str, str]:
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text(STAND_IN)
    info = root / "torch-2.9.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0\n")
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TORCH_MARK": str(root / "mark")}


def _parse(tmp_path: Path, *argv: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """Build ``kvtrio serve``'s parser for ``argv`` (which imports mlx-lm's server) and
    print what ``sys.modules`` holds for torch."""
    env = _stand_in_torch(tmp_path / "site")
    code = (
        "import sys\n" + prelude + "from kvtrio.cli import _build_parser\n"
        "words = ['serve', '--model', 'unused', *sys.argv[1:]]\n"
        "_build_parser(words).parse_args(words)\n"
        "print(repr(sys.modules.get('torch', 'absent'))[:20])\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=120
    )


def test_kvtrio_serve_keeps_an_installed_pytorch_out_of_its_process(tmp_path: Path) -> None:
    done = _parse(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"  # find_spec("torch") finds nothing
    assert not (tmp_path / "site" / "mark").exists()


def test_the_stand_in_is_what_transformers_imports_when_torch_is_left_in(
    tmp_path: Path,
) -> None:
    """The check above can fail: with PyTorch left importable, mlx-lm's server import
    imports it (through transformers), as it does in mlx_lm.server."""
    done = _parse(tmp_path, "--import-torch")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("<module 'torch'")
    assert (tmp_path / "site" / "mark").read_text() == "imported\n"


@pytest.mark.parametrize("flag", ["--trust-remote-code", "--import-t", "--trust-remote"])
def test_remote_code_or_an_abbreviated_flag_leaves_pytorch_importable(
    tmp_path: Path, flag: str
) -> None:
    done = _parse(tmp_path, flag)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "mark").exists()


def test_a_transformers_that_needs_pytorch_is_a_usage_error_naming_the_flag(
    tmp_path: Path,
) -> None:
    """A transformers whose import needs PyTorch (stood in for by a server module whose
    mlx-lm flags do ``import torch``) stops the command with exit status 2, not a
    traceback."""
    prelude = (
        "import types\n"
        "server = types.ModuleType('kvtrio.serve.server')\n"
        "def needs_torch(parser):\n"
        "    import torch\n"
        "server.add_mlx_server_arguments = needs_torch\n"
        "server.add_kvtrio_arguments = lambda parser, **kwargs: None\n"
        "sys.modules['kvtrio.serve.server'] = server\n"
    )
    done = _parse(tmp_path, prelude=prelude)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "--import-torch" in done.stderr
