"""AUTOMATIC1111's web UI API (``/sdapi/v1/...``) as our requests, both ways, without I/O.

``generation.py`` (``txt2img`` / ``img2img`` bodies checked and mapped to
a model's params), ``answers.py`` (the generation answer, its ``info``,
the lists), ``names.py`` (sampler and schedule names as A1111 lists them),
``options.py`` (``/options`` per principal, checkpoint names), ``jobs.py``
(the calls running per principal, ``/progress``), ``masks.py`` (an
img2img mask blurred as A1111 blurs it), ``inpaint_area.py`` (a masked
img2img's "Only masked", fill and overlay, as A1111's), ``unfinished.py`` (the picture of
an image ``/interrupt`` stopped), ``infotext.py``
(``/png-info``), ``auth.py`` (basic auth as the token), ``errors.py``
(A1111's error shape). The routes are ``omni_stream/server/a1111_api.py``;
docs/a1111.md says what maps to what and what is refused.
"""

from __future__ import annotations

from .errors import error_body, status_of
from .generation import Generation, model_params, parse_generation
from .infotext import a1111_fields, request_of

__all__ = [
    "Generation",
    "a1111_fields",
    "error_body",
    "model_params",
    "parse_generation",
    "request_of",
    "status_of",
]
