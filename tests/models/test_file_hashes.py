"""A1111's hashes of weight files: the model's of the whole file, a LoRA's of its tensors alone."""

from __future__ import annotations

import hashlib
import json

from omni_stream.models.diffusers.file_hashes import lora_hash, model_hash


def _safetensors(path, metadata: dict[str, str]) -> bytes:
    """A one-tensor safetensors file written by hand: 8-byte length, JSON header, data."""
    data = bytes(range(16))
    header = json.dumps(
        {"__metadata__": metadata, "w": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}}
    )
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + data)
    return data


def test_model_hash_is_the_first_10_hex_of_the_files_sha256(tmp_path):
    path = tmp_path / "x.safetensors"
    _safetensors(path, {})
    assert model_hash(path) == hashlib.sha256(path.read_bytes()).hexdigest()[:10]


def test_lora_hash_skips_the_header_so_metadata_edits_keep_it(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    data = _safetensors(a, {"ss_output_name": "ink"})
    _safetensors(b, {"ss_output_name": "renamed, with a longer header"})
    assert lora_hash(a) == lora_hash(b) == hashlib.sha256(data).hexdigest()[:12]
    assert model_hash(a) != model_hash(b)
    # A diffusers LoRA folder: the file save_lora_weights wrote in it.
    (tmp_path / "ink").mkdir()
    _safetensors(tmp_path / "ink" / "pytorch_lora_weights.safetensors", {})
    assert lora_hash(tmp_path / "ink") == lora_hash(a)
    # No file here (a hub id), a folder without it: no hash.
    assert lora_hash("someone/some-lora") is None and lora_hash(tmp_path) is None
