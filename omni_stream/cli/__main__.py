"""``python -m omni_stream.cli``: the ``omni-stream`` command (the tests and benchmarks start a server so).

The command's classes are imported from their modules, never defined in this
``__main__``: a ModelLoader pickles to Ray's replicas by reference.
"""

from __future__ import annotations

from . import entry

entry()
