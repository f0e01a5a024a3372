"""The one rule for request ids, shared by the wire, the client and every engine (pure).

An id ends up in logs, headers, file names and URL paths
(``/v1/generations/{id}/output``), so it is kept plain: 1 to
:data:`MAX_ID_LENGTH` characters from ``A-Z a-z 0-9 . _ : -``, and not ``.``
or ``..``, which are path segments a URL normalises away (a request with
such an id could be neither fetched nor cancelled over HTTP).

:func:`id_problem` says what is wrong with a candidate; each caller raises
its own error with it (the wire's ``invalid_field``, the engine's and the
client's ParamsError), so the rule is written once and worded once.
"""

from __future__ import annotations

import re
from typing import Any, Final

__all__ = [
    "ID_PATTERN",
    "ID_RULE",
    "MAX_ID_LENGTH",
    "MODEL_NAME",
    "MODEL_NAME_RULE",
    "id_problem",
    "is_valid_id",
    "model_name_problem",
]

MAX_ID_LENGTH: Final = 128
ID_PATTERN: Final = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_ID_LENGTH}}}")
#: The rule in words, for error messages.
ID_RULE: Final = f"1-{MAX_ID_LENGTH} characters from A-Z a-z 0-9 . _ : -, not '.' or '..'"

_DOT_SEGMENTS: Final = frozenset({".", ".."})
_ECHO = 64


def id_problem(value: Any, *, name: str = "id") -> str | None:
    """Why ``value`` is not a request id (a sentence naming ``name``), or None when it is one."""
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        return f"{name} must be a string ({ID_RULE}), got {kind}"
    if not ID_PATTERN.fullmatch(value) or value in _DOT_SEGMENTS:
        shown = value if len(value) <= _ECHO else value[:_ECHO] + "..."
        return f"{name} must be {ID_RULE}; got {shown!r}"
    return None


def is_valid_id(value: Any) -> bool:
    """Whether ``value`` follows the rule (see the module docstring)."""
    return isinstance(value, str) and value not in _DOT_SEGMENTS and ID_PATTERN.fullmatch(value) is not None


#: A served model's name (``serve --model NAME=SPEC``, a request's ``model``):
#: it travels in URLs, logs and the wire too.
MODEL_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MODEL_NAME_RULE: Final = "1-64 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"


def model_name_problem(value: Any, *, name: str = "model") -> str | None:
    """Why ``value`` is not a model name (a sentence naming ``name``), or None when it is one."""
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        return f"{name} must be a string ({MODEL_NAME_RULE}), got {kind}"
    if not MODEL_NAME.fullmatch(value):
        shown = value if len(value) <= _ECHO else value[:_ECHO] + "..."
        return f"{name} must be {MODEL_NAME_RULE}; got {shown!r}"
    return None
