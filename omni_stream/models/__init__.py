"""Built-in models: ``Mixture`` (the embedded default) and ``Synthetic`` (load and faults).

``omni_stream.models.diffusers`` (the diffusers adapter) is imported on
demand: it needs the ``diffusers`` extra.
"""

from __future__ import annotations

from .mixture import Mixture
from .registry import BUILTIN_MODELS, load_model
from .synthetic import Synthetic, SyntheticFault

__all__ = ["Mixture", "Synthetic", "SyntheticFault", "BUILTIN_MODELS", "load_model"]
