"""`import omni_stream` needs only torch, anyio and numpy: the GPU check relies on it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_engine_imports_without_websockets_or_pytest_asyncio():
    code = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("websockets", "pytest_asyncio"):
                    raise ModuleNotFoundError(name)
                return None

        sys.meta_path.insert(0, Block())
        import omni_stream as om
        assert om.Engine and om.models.Mixture and om.models.Synthetic
        try:
            om.client
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("the client imported without websockets?")
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
