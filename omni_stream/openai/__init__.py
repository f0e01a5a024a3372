"""OpenAI's API shapes for our requests, both ways, without I/O.

``images.py`` (the Images API: requests in, answers and stream events out),
``errors.py`` (OpenAI's error body and the statuses its SDKs map to their
exception types), ``models.py`` (``GET /v1/models``). The routes that use
them are ``omni_stream/server/openai_api.py``; docs/openai.md says what
maps to what.
"""

from __future__ import annotations

from .errors import OpenAIError, error_body, from_ours
from .images import ImagesRequest, parse_images_request
from .models import models_list

__all__ = ["ImagesRequest", "OpenAIError", "error_body", "from_ours", "models_list", "parse_images_request"]
