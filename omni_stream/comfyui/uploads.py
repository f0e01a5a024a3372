"""Images uploaded for ``LoadImage`` (``POST /upload/image``), kept per principal, bounded (pure).

ComfyUI clients upload an image first, then name it in a workflow's
``LoadImage``. An upload here is held in memory, never written to disk,
and only its owner (the principal that uploaded it) can name or fetch it.
The door checks its bytes from their header first (a PNG, JPEG or WebP
within ``max_image_size``, core/inputs.py), so what is kept is an image
the core would take; here it is only kept, within bounds:

- at most ``per_owner`` uploads per principal (its oldest goes first);
- at most ``total`` in all: past it, the oldest upload of the principal
  holding the most goes (one principal's flood evicts its own, never
  another's that holds less), as the registry evicts retained results;
- every byte counted in the server's memory budget while it is kept.

Names are ComfyUI's: ``name`` in an optional ``subfolder``, a workflow
naming ``subfolder/name``; a name taken is renamed ``name (1).png`` unless
the upload asks to ``overwrite``. Both are reduced to plain characters: a
name is a key here, never a path.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

__all__ = ["Upload", "UploadStore"]

_MAX_NAME: Final = 128
_MAX_FOLDER: Final = 64


class _Budget(Protocol):
    def add(self, n: int) -> None: ...
    def release(self, n: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Upload:
    """One kept upload: its name, its folder, its bytes."""

    name: str
    subfolder: str
    data: bytes = field(repr=False)
    mime: str = "application/octet-stream"

    @property
    def key(self) -> str:
        """What a ``LoadImage`` names it by."""
        return f"{self.subfolder}/{self.name}" if self.subfolder else self.name


class UploadStore:
    """Uploads by owner (see the module docstring)."""

    def __init__(self, *, per_owner: int = 16, total: int = 64, budget: _Budget | None = None) -> None:
        self.per_owner = per_owner
        self.total = total
        self._budget = budget
        #: owner -> key -> upload, oldest first.
        self._owners: dict[str, OrderedDict[str, Upload]] = {}

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._owners.values())

    def put(
        self, owner: str, name: str, data: bytes, *, mime: str, subfolder: str = "", overwrite: bool = False
    ) -> Upload:
        """Keep ``data`` (of type ``mime``) as ``owner``'s ``subfolder/name`` (renamed if taken,
        unless ``overwrite``)."""
        name = _plain(name, _MAX_NAME) or "image.png"
        folder = _plain(subfolder, _MAX_FOLDER)
        taken: Mapping[str, Upload] = self._owners.get(owner, {})
        upload = Upload(name, folder, data, mime)
        if not overwrite:
            stem, dot, ext = name.rpartition(".")
            if not dot:
                stem, ext = name, ""
            n = 1
            while upload.key in taken:
                upload = Upload(f"{stem} ({n}){dot}{ext}", folder, data, mime)
                n += 1
        self._drop(owner, upload.key)  # overwritten
        kept = self._owners.setdefault(owner, OrderedDict())
        kept[upload.key] = upload
        if self._budget is not None:
            self._budget.add(len(data))
        while len(kept) > self.per_owner:
            self._drop(owner, next(iter(kept)))
        while len(self) > self.total:
            largest = max(self._owners, key=lambda o: len(self._owners[o]))
            self._drop(largest, next(iter(self._owners[largest])))
        return upload

    def get(self, owner: str, key: str) -> Upload | None:
        """``owner``'s upload named ``key`` (``subfolder/name`` or ``name``); None otherwise."""
        kept = self._owners.get(owner)
        return None if kept is None else kept.get(key)

    def names(self, owner: str) -> tuple[str, ...]:
        """``owner``'s uploads, as a ``LoadImage`` names them, oldest first."""
        return tuple(self._owners.get(owner, {}))

    def _drop(self, owner: str, key: str) -> None:
        kept = self._owners.get(owner)
        if kept is None or key not in kept:
            return
        upload = kept.pop(key)
        if self._budget is not None:
            self._budget.release(len(upload.data))
        if not kept:
            del self._owners[owner]


def _plain(text: str, limit: int) -> str:
    """``text``'s last path part in plain characters (letters, digits, ``. _ - ( )`` and spaces)."""
    last = text.replace("\\", "/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._() -]", "", last).strip().lstrip(".")[:limit]
