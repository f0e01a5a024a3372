"""Built-in models: ``Synthetic`` (load and faults), ``Mixture`` (the embedded default)."""

from __future__ import annotations

from .synthetic import Synthetic, SyntheticFault

__all__ = ["Synthetic", "SyntheticFault"]
