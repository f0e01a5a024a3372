"""A multipart form's fields and files, bounded (the OpenAI doors' uploads; pure parsing).

:func:`read_form` reads a body already read under the server's bounds
(bodies.py) as ``multipart/form-data``: its text fields, nested the way the
OpenAI SDK sends objects and lists (``webhook[url]``, ``webhook[events][]``),
and the file fields a route takes, each at most ``max_part_size`` bytes and
one file each. Every refusal is an OpenAIError naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.datastructures import Headers
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from ..openai.errors import OpenAIError

__all__ = ["read_form"]

#: Text fields a form may hold: an images request has about a dozen.
_MAX_FORM_FIELDS = 64


async def read_form(
    request: Request, body: bytes, *, files: Mapping[str, str], max_part_size: int
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """A multipart body's fields (strings) and its files (bytes) by field name; ``files``
    names the file fields allowed (and what each is, for the error). Raises OpenAIError."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise OpenAIError(
            400, f"the body must be multipart/form-data, got {content_type[:60]!r}", "bad_message"
        )

    async def replay() -> Any:
        yield body

    parser = MultiPartParser(
        Headers(headers={"content-type": content_type}),
        replay(),
        max_files=len(files) + 2,
        max_fields=_MAX_FORM_FIELDS,
        max_part_size=max_part_size,
    )
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise OpenAIError(400, f"the form does not parse: {exc.message}", "bad_message") from None
    fields: dict[str, Any] = {}
    found: dict[str, bytes] = {}
    try:
        for key, value in form.multi_items():
            if isinstance(value, str):
                _put_field(fields, key, value)
                continue
            name = key[:-2] if key.endswith("[]") else key  # the SDK's image[] for a list
            if name not in files:
                raise OpenAIError(
                    400,
                    f"unexpected file field {name[:40]!r}; this call takes {', '.join(files)}",
                    "invalid_field",
                    param=name,
                )
            if name in found:
                # OpenAI's multi-image edit (image[] repeated): the models served here take one
                # input image a call (diffusers' img2img and inpaint pipelines), so it is refused
                # whole rather than run on the first image alone.
                raise OpenAIError(
                    400,
                    f"several {name!r} files were sent; the models here take one {name} a call "
                    "(a multi-image edit needs a pipeline that takes a list of images): send one",
                    "unsupported",
                    param=name,
                )
            found[name] = await value.read()
    finally:
        await form.close()
    return fields, found


def _put_field(fields: dict[str, Any], key: str, value: str) -> None:
    """A form field into ``fields``: the SDK sends an object as ``webhook[url]=...`` and a list
    as ``webhook[events][]=...`` (one field per item); they become the object and the list."""
    if "[" not in key:
        fields[key] = value
        return
    head, _, rest = key.partition("[")
    parts = [head, *rest.rstrip("]").split("][")]
    node: Any = fields
    for part, following in zip(parts, [*parts[1:], None], strict=True):
        if following is None:
            if part == "":
                raise OpenAIError(400, f"form field {key[:60]!r} is not a name", "invalid_field", param=head)
            node[part] = value
            return
        if following == "":  # name[]: a list of the values
            items = node.setdefault(part, [])
            if not isinstance(items, list):
                raise OpenAIError(
                    400, f"form field {key[:60]!r} mixes a list and a value", "invalid_field", param=head
                )
            items.append(value)
            return
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise OpenAIError(
                400, f"form field {key[:60]!r} mixes an object and a value", "invalid_field", param=head
            )
        node = child
