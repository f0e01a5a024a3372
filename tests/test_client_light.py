"""The websocket client is light: importing it imports no torch (issue #38).

``from omni_stream import client`` took 1.4-2.3 s because the package root
imported the engine (torch) first. The root now imports its names on first
use; a client, a bot or a page's backend that only talks to a server pays
for websockets and the protocol, not for a tensor library.
"""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "numpy", "PIL", "starlette", "uvicorn")


def _imported_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    return set(done.stdout.split())


def test_importing_the_client_imports_no_torch_and_no_server() -> None:
    for code in (
        "from omni_stream import client",
        "import omni_stream.client",
        "from omni_stream.client import connect, RequestStream",
        "import omni_stream as om; om.client.connect",
    ):
        loaded = _imported_after(code)
        assert not loaded & set(HEAVY), (code, sorted(loaded & set(HEAVY)))


def test_the_engine_is_still_one_attribute_away() -> None:
    loaded = _imported_after("import omni_stream as om\nassert om.Engine and om.models.Synthetic")
    assert "torch" in loaded
