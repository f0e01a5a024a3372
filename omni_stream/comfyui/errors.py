"""ComfyUI's error shapes: a refused workflow, and ours as ComfyUI's (pure).

ComfyUI answers a refused ``POST /prompt`` with 400 and::

    {"error": {"type", "message", "details", "extra_info"},
     "node_errors": {NODE_ID: {"errors": [{"type", "message", "details",
                                           "extra_info": {"input_name"}}],
                               "dependent_outputs": [...], "class_type"}}}

Its clients show ``error.message`` and mark the nodes of ``node_errors``
red, so every refusal of a workflow names the node and the input at
fault where there is one: a class we do not run, a missing link, a link
of the wrong type, a value out of range, a mapping we cannot make, and
the core's own refusals (a param the model refused names the node input
it came from). :class:`WorkflowError` carries one; the door answers it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ParamsError

__all__ = ["NodeError", "WorkflowError", "error_body"]


@dataclass(frozen=True, slots=True)
class NodeError:
    """One node's fault: its id and class, ComfyUI's error ``type``, the words, and the input."""

    node_id: str
    class_type: str
    type: str
    message: str
    input_name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        extra = {} if self.input_name is None else {"input_name": self.input_name}
        return {
            "type": self.type,
            "message": self.message,
            "details": self.input_name or "",
            "extra_info": extra,
        }


class WorkflowError(ParamsError):
    """A workflow refused before it runs: ComfyUI's prompt-level ``type`` and the nodes at fault.

    A ParamsError (a workflow is a request's params); ``field`` is the first
    node input at fault, as ``NODE_ID.INPUT``. ``status`` is the HTTP status
    to answer (400 for a workflow, 429 / 503 for a busy server),
    ``retry_after_s`` its ``Retry-After``.
    """

    def __init__(
        self,
        message: str,
        *,
        type: str = "prompt_outputs_failed_validation",
        nodes: Sequence[NodeError] = (),
        status: int = 400,
        retry_after_s: float | None = None,
    ) -> None:
        first = next(iter(nodes), None)
        field = None if first is None else f"{first.node_id}.{first.input_name or 'class_type'}"
        super().__init__(message, field=field)
        self.type = type
        self.nodes = tuple(nodes)
        self.status = status
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> Any:
        return (_rebuild, (self.message, self.type, self.nodes, self.status, self.retry_after_s))

    def body(self, outputs: Sequence[str] = ()) -> dict[str, Any]:
        """ComfyUI's 400 body; ``outputs``: the workflow's output nodes (``dependent_outputs``)."""
        return error_body(self.message, type=self.type, nodes=self.nodes, outputs=outputs)


def _rebuild(
    message: str, type: str, nodes: tuple[NodeError, ...], status: int, retry: float | None
) -> WorkflowError:
    return WorkflowError(message, type=type, nodes=nodes, status=status, retry_after_s=retry)


def error_body(
    message: str,
    *,
    type: str,
    nodes: Sequence[NodeError] = (),
    outputs: Sequence[str] = (),
    details: str = "",
) -> dict[str, Any]:
    """``{"error": {...}, "node_errors": {...}}`` as ComfyUI answers a refused prompt."""
    node_errors: dict[str, dict[str, Any]] = {}
    for fault in nodes:
        entry = node_errors.setdefault(
            fault.node_id,
            {"errors": [], "dependent_outputs": list(outputs), "class_type": fault.class_type},
        )
        entry["errors"].append(fault.as_dict())
    if not details and nodes:
        details = "; ".join(f"#{n.node_id} {n.class_type}: {n.message}" for n in nodes)
    return {
        "error": {"type": type, "message": message, "details": details, "extra_info": {}},
        "node_errors": node_errors,
    }
