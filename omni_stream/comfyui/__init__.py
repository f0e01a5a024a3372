"""ComfyUI's API shapes for our requests, both ways, without I/O (docs/comfyui.md).

``nodes.py`` (the node classes we run, as ``/object_info`` lists them),
``graph.py`` (a workflow in API format, read and checked node by node),
``workflow.py`` (a checked workflow mapped onto one request: ``plan_workflow``),
``plan.py`` (what it becomes: the request, and which node input each param
came from), ``errors.py`` (ComfyUI's error body, ``WorkflowError``),
``messages.py`` (ComfyUI's websocket messages and binary preview frames,
from our typed messages), ``book.py`` (the posted prompts and their history,
per principal), ``uploads.py`` (``LoadImage``'s uploaded images, per
principal, bounded). The routes that use them are
``omni_stream/server/comfyui_api.py`` and ``comfyui_ws.py``.
"""

from __future__ import annotations

from .book import Prompt, PromptBook
from .errors import NodeError, WorkflowError, error_body
from .graph import Graph, read_workflow
from .messages import Translator, preview_frame, status
from .nodes import ACCEPTED, NODES, Choices, object_info
from .plan import ModelCard, Output, Plan, comfy_samplers
from .uploads import Upload, UploadStore
from .workflow import plan_workflow

__all__ = [
    "ACCEPTED",
    "NODES",
    "Choices",
    "Graph",
    "ModelCard",
    "NodeError",
    "Output",
    "Plan",
    "Prompt",
    "PromptBook",
    "Translator",
    "Upload",
    "UploadStore",
    "WorkflowError",
    "comfy_samplers",
    "error_body",
    "object_info",
    "plan_workflow",
    "preview_frame",
    "read_workflow",
    "status",
]
