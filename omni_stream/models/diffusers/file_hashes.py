"""AUTOMATIC1111's hashes of weight files: how a PNG's infotext names the weights behind it.

A1111 writes ``Model hash: 6ce0161689`` (the first 10 hex digits of the
checkpoint file's sha256) and ``Lora hashes: "ink: 1f3a6c0b2d4e"`` (the
first 12 of a LoRA's kohya "addnet" hash: the sha256 of a ``.safetensors``
file's bytes after its header, so that editing the metadata does not change
it; civitai calls it AutoV3). Tools that read infotexts (civitai, A1111's
own checkpoint switch) look weights up by them, so ours are computed the
same way. Pure file reading: no torch.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Final

__all__ = ["MODEL_HASH_DIGITS", "LORA_HASH_DIGITS", "lora_hash", "model_hash"]

#: Hex digits A1111 writes of a checkpoint's sha256 (its ``shorthash``).
MODEL_HASH_DIGITS: Final = 10
#: Hex digits A1111 writes of a LoRA's addnet hash.
LORA_HASH_DIGITS: Final = 12
_CHUNK: Final = 1 << 20
# What diffusers' save_lora_weights writes in a LoRA folder.
_LORA_FOLDER_FILE: Final = "pytorch_lora_weights.safetensors"


def _sha256(path: Path, start: int = 0) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        file.seek(start)
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def model_hash(path: str | os.PathLike[str]) -> str:
    """A checkpoint file's ``Model hash`` as A1111 writes it. Raises OSError for a file it cannot read."""
    return _sha256(Path(path))[:MODEL_HASH_DIGITS]


def lora_hash(path: str | os.PathLike[str]) -> str | None:
    """A LoRA's ``Lora hashes`` entry as A1111 writes it: a ``.safetensors`` file's addnet hash
    (a folder: the file ``save_lora_weights`` wrote in it); another file's whole sha256; None
    for a folder without that file, or a name that is no file here (a hub id). Raises OSError
    for a file it cannot read."""
    file = Path(path)
    if file.is_dir():
        file = file / _LORA_FOLDER_FILE
    if not file.is_file():
        return None
    if file.suffix.lower() != ".safetensors":
        return _sha256(file)[:LORA_HASH_DIGITS]
    with file.open("rb") as handle:
        header = int.from_bytes(handle.read(8), "little")
    # The tensors start after the 8-byte length and the JSON header it counts.
    return _sha256(file, 8 + header)[:LORA_HASH_DIGITS]
