"""Shared by the model tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import one_torch_thread


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def check_size_param(model, side: int, other: int, off_grid: int) -> None:
    """``size`` sets both sides; a different side beside it, or an off-grid size, is refused naming ``size``."""
    from omni_stream import ParamsError

    square = model.validate({"size": side})
    assert (square["height"], square["width"]) == (side, side)
    assert model.validate({"size": side, "height": side})["width"] == side  # the same value: fine
    with pytest.raises(ParamsError) as err:
        model.validate({"size": side, "width": other})
    assert err.value.field == "size"
    assert f"'size' ({side})" in err.value.message and f"'width' ({other})" in err.value.message
    with pytest.raises(ParamsError) as err:
        model.validate({"size": off_grid})
    assert err.value.field == "size" and "multiple of" in err.value.message


def letter_vocab(folder: Path) -> tuple[int, tuple[str, str]]:
    """A CLIP tokenizer's files written in ``folder``: a vocabulary of letters (each alone and
    word-final), no merges. Its size, and the (vocab.json, merges.txt) paths ``CLIPTokenizer``
    takes."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return len(vocab), (str(folder / "vocab.json"), str(folder / "merges.txt"))
