"""Declared model parameters and their validation (pure, no I/O).

Models declare their params as a tuple of :class:`Param`; :func:`validate`
turns a caller's mapping into a complete dict of checked values or raises
:class:`~omni_stream.errors.ParamsError` naming the field and what was wrong.
The same declarations drive ``omni-stream models``, the server's checks and
the browser page's form.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ParamsError

__all__ = ["Param", "validate", "describe", "positive_int", "square_size"]

_KINDS = ("int", "float", "str", "bool", "shape")


def positive_int(
    value: object,
    name: str,
    *,
    env: str | None = None,
    what: str | None = None,
    request_id: str | None = None,
) -> int:
    """``value`` if it is an int of at least 1, else ParamsError naming it.

    The one check of a positive-integer option, argument or result. ``name``
    is the option (the error's ``field``); ``what`` words it in the message
    where the name alone would not say enough (default: ``name``); ``env``
    is the environment variable behind it, where there is one, named too.
    A bool is not an int here, and neither is an integral float.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        subject = what or name
        if env:
            subject += f" ({env})"
        raise ParamsError(
            f"{subject} must be a positive integer, got {value!r}", field=name, request_id=request_id
        )
    return value


@dataclass(frozen=True, slots=True)
class Param:
    """One declared parameter.

    ``kind`` is one of ``int``, ``float``, ``str``, ``bool`` or ``shape`` (a
    list of positive ints). ``default`` of ``None`` means optional with no
    value. ``minimum``/``maximum`` bound numbers (and each entry of a shape);
    ``choices`` restricts strings.
    """

    name: str
    kind: str
    default: Any
    help: str = ""
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    max_len: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Param {self.name!r}: kind must be one of {_KINDS}")

    def check(self, value: Any, *, model: str) -> Any:
        """Return ``value`` converted to this param's kind, or raise ParamsError."""
        where = f"{model} param {self.name!r}"
        if value is None:
            if self.default is None:
                return None
            raise ParamsError(f"{where} must not be null", field=self.name)
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ParamsError(f"{where} must be true or false, got {value!r}", field=self.name)
            return value
        if self.kind == "int":
            # bool is an int subclass; a float with an integral value (JSON 30.0) is accepted.
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ParamsError(f"{where} must be an integer, got {value!r}", field=self.name)
            if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
                raise ParamsError(f"{where} must be an integer, got {value!r}", field=self.name)
            return self._bounded(int(value), where)
        if self.kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ParamsError(f"{where} must be a number, got {value!r}", field=self.name)
            if not math.isfinite(value):
                raise ParamsError(f"{where} must be finite, got {value!r}", field=self.name)
            return self._bounded(float(value), where)
        if self.kind == "str":
            if not isinstance(value, str):
                raise ParamsError(f"{where} must be a string, got {value!r}", field=self.name)
            if self.max_len is not None and len(value) > self.max_len:
                raise ParamsError(
                    f"{where} is longer than {self.max_len} characters", field=self.name
                )
            if self.choices is not None and value not in self.choices:
                raise ParamsError(
                    f"{where} must be one of {', '.join(self.choices)}; got {value!r}",
                    field=self.name,
                )
            return value
        # shape
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
            raise ParamsError(
                f"{where} must be a non-empty list of positive integers, got {value!r}",
                field=self.name,
            )
        if self.max_len is not None and len(value) > self.max_len:
            raise ParamsError(f"{where} has more than {self.max_len} dimensions", field=self.name)
        dims = []
        for dim in value:
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                raise ParamsError(
                    f"{where} must be a list of positive integers, got {value!r}",
                    field=self.name,
                )
            dims.append(self._bounded(dim, where))
        return tuple(dims)

    def _bounded(self, value: float, where: str) -> Any:
        if self.minimum is not None and value < self.minimum:
            raise ParamsError(
                f"{where} must be >= {self._bound_text(self.minimum)}, got {value!r}", field=self.name
            )
        if self.maximum is not None and value > self.maximum:
            raise ParamsError(
                f"{where} must be <= {self._bound_text(self.maximum)}, got {value!r}", field=self.name
            )
        return value

    def _bound_text(self, bound: float) -> str:
        # The user must be able to type the limit back in: an integer bound
        # such as a seed's 2**63 - 1 reads "9.22337e+18" with :g.
        if isinstance(bound, int) or (self.kind in ("int", "shape") and float(bound).is_integer()):
            return str(int(bound))
        text = f"{bound:g}"
        return text if float(text) == bound else repr(float(bound))


def validate(
    specs: Sequence[Param], params: Mapping[str, Any] | None, *, model: str
) -> dict[str, Any]:
    """Check ``params`` against ``specs`` and fill in defaults.

    Raises ParamsError for a non-mapping, an unknown key (the message lists
    the known ones) or a bad value (the message names the field).
    """
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ParamsError(f"{model} params must be an object, got {type(params).__name__}")
    known = {p.name: p for p in specs}
    unknown = sorted(str(k) for k in params if k not in known)
    if unknown:
        raise ParamsError(
            f"unknown {model} param(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known))}",
            field=unknown[0],
        )
    out: dict[str, Any] = {}
    for spec in specs:
        out[spec.name] = spec.check(params.get(spec.name, spec.default), model=model)
    return out


def square_size(out: dict[str, Any], given: Mapping[str, Any] | None, *, model: str) -> None:
    """Resolve a checked ``size`` (both sides at once) into ``out``'s ``height`` and ``width``.

    ``given`` is the caller's mapping: a ``size`` it names wins over the
    sides' defaults, and a side it names must equal it (``{"size": 512,
    "height": 512}`` is fine, ``{"size": 512, "height": 256}`` is not). A
    ``size`` that only comes from a default applies when neither side is
    given. Raises ParamsError (field ``size``) naming both values.
    """
    size = out.get("size")
    if size is None:
        return
    given = given if isinstance(given, Mapping) else {}
    sides = [s for s in ("height", "width") if s in given and given[s] is not None]
    if "size" not in given and sides:
        return  # a default size never overrides a side the caller chose
    for side in sides:
        if out[side] != size:
            raise ParamsError(
                f"{model} param 'size' ({size}) and {side!r} ({out[side]}) differ; "
                "give 'size' for a square, or 'height' and 'width'",
                field="size",
            )
    out["height"] = out["width"] = size


def describe(specs: Sequence[Param]) -> list[dict[str, Any]]:
    """JSON-ready descriptions of ``specs`` (for ``omni-stream models`` and the page)."""
    rows = []
    for p in specs:
        row: dict[str, Any] = {"name": p.name, "kind": p.kind, "default": p.default, "help": p.help}
        if p.minimum is not None:
            row["minimum"] = p.minimum
        if p.maximum is not None:
            row["maximum"] = p.maximum
        if p.choices is not None:
            row["choices"] = list(p.choices)
        rows.append(row)
    return rows
