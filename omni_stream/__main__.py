"""``python -m omni_stream``: the same as the ``omni-stream`` command."""

from __future__ import annotations

from .cli import entry

entry()
