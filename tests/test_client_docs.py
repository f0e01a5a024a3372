"""docs/client.md's examples run as written, against a real server on the embedded model (issue #38).

Each ```python block of the page defines ``main(url)`` (and may define
more); the test runs it in a temporary folder against a real uvicorn
server serving Mixture, so an example that stops working fails here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from omni_stream.models import Mixture

from .server.conftest import running

DOC = Path(__file__).resolve().parent.parent / "docs" / "client.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_page_has_its_examples() -> None:
    assert len(BLOCKS) >= 4 and all("async def main(url" in block for block in BLOCKS)


@pytest.mark.asyncio
@pytest.mark.parametrize("index", range(len(BLOCKS)))
async def test_each_example_runs_against_a_real_server(
    index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(BLOCKS[index], f"{DOC}:block{index}", "exec"), namespace)
    monkeypatch.chdir(tmp_path)
    token = "s3cret" if "token" in BLOCKS[index] else None
    async with running(Mixture(), token=token) as server:
        await namespace["main"](server.url)
    printed = capsys.readouterr().out
    assert printed  # every example says what it got
    if "result.png" in BLOCKS[index]:
        assert (tmp_path / "result.png").stat().st_size > 0
    if "cancel(" in BLOCKS[index]:
        assert "cancelled: long-1 at step" in printed
    if "attach(" in BLOCKS[index]:
        assert "done: True" in printed
