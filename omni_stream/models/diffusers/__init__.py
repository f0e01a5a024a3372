"""Stream diffusers pipelines through the engine (needs the ``diffusers`` extra).

``Diffusers(pipe)`` picks the adapter: native step-wise loops for UNet
pipelines (:mod:`.unet`), SD3 (:mod:`.sd3`) and Flux (:mod:`.flux`), callback
mode for every other pipeline (:mod:`.callback`). :mod:`.base` says how.
"""

from __future__ import annotations

from .base import MODES, Diffusers, EncodePrompt, PromptEmbeddings, adapter_for

__all__ = ["Diffusers", "PromptEmbeddings", "EncodePrompt", "MODES", "adapter_for"]
