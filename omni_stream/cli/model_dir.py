"""``serve --model-dir DIR``: an AUTOMATIC1111 or ComfyUI checkpoint folder, a model per file.

Each ``.safetensors`` file directly in DIR (not in its subfolders) is a model
named by its stem, served like ``--model STEM=PATH``: built when the server
starts, and on the device only while requests need it when ``--max-loaded``
bounds how many are. The folder's other files are passed over, each with a
warning saying why: pickled checkpoints (``.ckpt``, ``.pt``, ``.pth``,
``.bin``: loading one runs its code), stems that are not model names, and
files whose header (read alone, no weights) is no architecture the adapters
stream (an inpainting model, a VAE). A folder left with no model is an error.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..ids import MODEL_NAME_RULE, model_name_problem
from .console import UsageError

__all__ = ["model_dir_specs"]

logger = logging.getLogger("omni_stream.models")


def model_dir_specs(folder: str) -> list[tuple[str, str]]:
    """``(name, path)`` of each checkpoint in ``folder`` that loads, in name order; a warning
    for each file passed over. Raises UsageError for a folder that is not one, or has none."""
    from ..models.diffusers.single_file import SINGLE_FILE_SUFFIX, detect, is_single_file, pickle_refusal

    root = Path(folder)
    option = f"--model-dir {folder}"
    if not root.is_dir():
        raise UsageError(f"{option}: not a folder")
    found: list[tuple[str, str]] = []
    for entry in sorted(root.iterdir()):
        if not entry.is_file() or not is_single_file(entry):
            continue
        refusal = pickle_refusal(entry)
        if refusal is not None:
            logger.warning("%s: not served: %s", option, refusal)
            continue
        if model_name_problem(entry.stem) is not None:
            logger.warning(
                "%s: %s not served: its stem is no model name (%s); serve it as --model NAME=%s",
                option,
                entry.name,
                MODEL_NAME_RULE,
                entry,
            )
            continue
        try:
            detect(entry)
        except ImportError as exc:
            raise UsageError(f"{option}: {exc}") from None
        except ValueError as exc:
            logger.warning("%s: not served: %s", option, exc)
            continue
        found.append((entry.stem, str(entry)))
    if not found:
        raise UsageError(
            f"{option}: holds no checkpoint that loads ({SINGLE_FILE_SUFFIX} files, see the warnings)"
        )
    return found
