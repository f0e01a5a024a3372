"""Declared model parameters and their validation (pure, no I/O).

Models declare their params as a tuple of :class:`Param`; :func:`validate`
turns a caller's mapping into a complete dict of checked values or raises
:class:`~omni_stream.errors.ParamsError` naming the field and what was wrong.
The same declarations drive ``omni-stream models``, the server's checks and
the browser page's form.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .errors import ParamsError

__all__ = [
    "MAX_IMAGES",
    "RANDOM",
    "SEED_MAX",
    "Param",
    "describe",
    "drawn",
    "finite_number",
    "images_param",
    "positive_int",
    "seed_param",
    "square_size",
    "validate",
]

_KINDS = ("int", "float", "str", "bool", "shape", "object")

#: The value of a ``random`` param that asks for a fresh draw (A1111's "random seed").
RANDOM = -1
#: The largest seed a request may name (a torch generator takes 64 bits; the
#: sign bit is left alone so every seed is a non-negative int64).
SEED_MAX = 2**63 - 1
# Drawn seeds are 32-bit: short enough to read, type back and hold exactly in
# a JavaScript number (the page), and 4 billion of them are plenty to tell
# requests apart. A named seed may still be any value up to SEED_MAX.
_DRAWN_BITS = 32


def finite_number(value: float) -> bool:
    """Whether ``value`` is a number a float holds (an int of 400 digits is not: OverflowError)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


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

    ``kind`` is one of ``int``, ``float``, ``str``, ``bool``, ``shape`` (a
    list of positive ints) or ``object`` (a JSON object of the named
    ``fields``, each a Param of its own; one left out takes its default, an
    unknown one is an error naming it, ``cache.method``). ``default`` of
    ``None`` means optional with no value. ``minimum``/``maximum`` bound numbers (and each entry of a shape);
    ``choices`` restricts strings. A ``random`` int param (a seed) takes
    :data:`RANDOM` (-1), null or nothing as "draw one": :func:`validate`
    puts a fresh value in ``[0, 2**32)`` in its place, so the checked
    params always say which value was used.
    """

    name: str
    kind: str
    default: Any
    help: str = ""
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    max_len: int | None = None
    random: bool = False
    fields: tuple[Param, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Param {self.name!r}: kind must be one of {_KINDS}")
        if (self.kind == "object") != bool(self.fields):
            raise ValueError(f"Param {self.name!r}: an object param, and only one, has fields")
        if self.random and self.kind != "int":
            raise ValueError(f"Param {self.name!r}: only an int param can be random")

    def check(self, value: Any, *, model: str) -> Any:
        """Return ``value`` converted to this param's kind, or raise ParamsError."""
        where = f"{model} param {self.name!r}"
        if self.random and (value is None or (type(value) in (int, float) and value == RANDOM)):
            return secrets.randbits(_DRAWN_BITS)
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
            if not finite_number(value):
                raise ParamsError(f"{where} must be a finite number, got {value!r:.40}", field=self.name)
            return self._bounded(float(value), where)
        if self.kind == "object":
            return self._check_object(value, model)
        if self.kind == "str":
            if not isinstance(value, str):
                raise ParamsError(f"{where} must be a string, got {value!r}", field=self.name)
            if self.max_len is not None and len(value) > self.max_len:
                raise ParamsError(f"{where} is longer than {self.max_len} characters", field=self.name)
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

    def _check_object(self, value: Any, model: str) -> dict[str, Any]:
        """An object param's value: every field checked, defaults filled in; the errors name
        the field as ``name.field``."""
        if not isinstance(value, Mapping):
            raise ParamsError(
                f"{model} param {self.name!r} must be an object, got {type(value).__name__}", field=self.name
            )
        known = {f.name: f for f in self.fields}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ParamsError(
                f"{model} param {self.name!r} has no field(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(known)}",
                field=f"{self.name}.{unknown[0]}",
            )
        default = self.default if isinstance(self.default, Mapping) else {}
        out = {}
        for f in self.fields:
            given = value[f.name] if f.name in value else default.get(f.name, f.default)
            try:
                out[f.name] = f.check(given, model=model)
            except ParamsError as exc:
                where = f"{self.name}.{f.name}"
                message = str(exc).replace(f"param {f.name!r}", f"param {where!r}", 1)
                if f.choices is not None and f.help:
                    message += f" ({f.help})"  # why these: a model says what it cannot do
                raise ParamsError(message, field=where) from None
        return out

    def with_default(self, value: Any, *, model: str) -> Param:
        """This param with ``value`` (checked) as its default; ParamsError naming it when bad.

        A random param keeps "draw one" (:data:`RANDOM`) for ``-1`` or None:
        checking would draw a seed and make it every request's default.
        """
        if self.random and (value is None or (type(value) in (int, float) and value == RANDOM)):
            return replace(self, default=RANDOM)
        return replace(self, default=self.check(value, model=model))

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


def validate(specs: Sequence[Param], params: Mapping[str, Any] | None, *, model: str) -> dict[str, Any]:
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
            f"unknown {model} param(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}",
            field=unknown[0],
        )
    out: dict[str, Any] = {}
    for spec in specs:
        out[spec.name] = spec.check(params.get(spec.name, spec.default), model=model)
    return out


def drawn(specs: Sequence[Param], checked: Mapping[str, Any]) -> dict[str, Any]:
    """The values :func:`validate` drew for ``specs``' random params (a seed), by name."""
    return {p.name: checked[p.name] for p in specs if p.random and p.name in checked}


def seed_param(help: str = "random seed") -> Param:
    """The ``seed`` every model declares: 0 to 2**63 - 1, or -1 (the default) for a random one."""
    return Param(
        "seed",
        "int",
        RANDOM,
        f"{help}; -1 (the default) draws one per request, reported back",
        minimum=0,
        maximum=SEED_MAX,
        random=True,
    )


#: The most images any model lets one request ask for (``num_images``).
MAX_IMAGES = 64


def images_param(maximum: int) -> Param:
    """``num_images``: how many images one request makes from its prompt, 1 to ``maximum``.

    A model that declares it hands out frames holding that many images
    along a leading dimension (``Frame.image_count``); the engine reads the
    param to know.
    """
    return Param(
        "num_images",
        "int",
        1,
        f"images from one prompt, 1 to {maximum} (num_images_per_prompt; one seed, one noise draw)",
        minimum=1,
        maximum=maximum,
    )


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
        if p.random:
            # -1 is a value the caller may send (and the page's field shows).
            row["random"] = True
            row["minimum"] = RANDOM
        elif p.minimum is not None:
            row["minimum"] = p.minimum
        if p.maximum is not None:
            row["maximum"] = p.maximum
        if p.choices is not None:
            row["choices"] = list(p.choices)
        if p.fields:
            row["fields"] = describe(p.fields)
        rows.append(row)
    return rows
