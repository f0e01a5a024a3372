"""A ComfyUI workflow in API format, read and checked node by node (pure).

The API format (ComfyUI's "Save (API)", what ``POST /prompt`` takes) is a
map of node ids to ``{"class_type", "inputs", "_meta"}``; an input is a
widget value or a link ``[NODE_ID, OUTPUT_INDEX]`` to another node's
output. :func:`read_workflow` checks all of it before anything is mapped:

- the shape (an object of nodes, at most :data:`MAX_NODES`), and a hint
  when it is the UI format (``nodes`` and ``links``) instead;
- every node's class is one of ours (nodes.py): any other is refused by
  name, with the list of those we run, as ComfyUI refuses a class it does
  not have ("Cannot execute because node X does not exist");
- every required input is there; a link points at a node of the workflow,
  at an output it has, of the type the input takes; a widget value is of
  its type, within its range, one of its choices where they are fixed.

Every fault of every node is collected and raised as one
:class:`~omni_stream.comfyui.errors.WorkflowError`, in ComfyUI's words
and error types, so a client marks all the nodes at fault at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from .errors import NodeError, WorkflowError
from .nodes import ACCEPTED, NODES, Input, Node

__all__ = ["MAX_NODES", "Graph", "GraphNode", "Link", "read_workflow"]

#: The most nodes a workflow may hold: the ones we run make a workflow of a dozen.
MAX_NODES: Final = 128
#: The longest node id (ComfyUI's are short numbers, "5" or "12:3" in a group node).
_MAX_ID: Final = 64
#: ComfyUI's prompt-level words for a workflow whose nodes failed their checks.
INVALID: Final = "Prompt outputs failed validation"


@dataclass(frozen=True, slots=True)
class Link:
    """An input fed by output ``output`` of node ``node_id``."""

    node_id: str
    output: int


@dataclass(frozen=True, slots=True)
class GraphNode:
    """One checked node: its id, class, inputs (links as :class:`Link`) and title."""

    id: str
    class_type: str
    inputs: Mapping[str, Any]
    title: str

    @property
    def schema(self) -> Node:
        return NODES[self.class_type]

    def link(self, name: str) -> Link:
        found = self.inputs[name]
        assert isinstance(found, Link)  # read_workflow checked every linked input
        return found

    def error(self, type: str, message: str, input_name: str | None = None) -> NodeError:
        return NodeError(self.id, self.class_type, type, message, input_name)


class Graph:
    """A checked workflow: its nodes by id (see :func:`read_workflow`)."""

    def __init__(self, nodes: Mapping[str, GraphNode]) -> None:
        self.nodes = dict(nodes)

    def __iter__(self) -> Iterator[GraphNode]:
        return iter(self.nodes.values())

    def source(self, node: GraphNode, input_name: str) -> tuple[GraphNode, int]:
        """The node feeding ``node``'s linked input, and which of its outputs."""
        link = node.link(input_name)
        return self.nodes[link.node_id], link.output

    def of_class(self, *classes: str) -> list[GraphNode]:
        return [n for n in self.nodes.values() if n.class_type in classes]


def read_workflow(prompt: Any) -> Graph:
    """``prompt`` (a ``POST /prompt``'s ``prompt``) as a checked :class:`Graph`.

    Raises WorkflowError: ``invalid_prompt`` for a shape that is not a
    workflow or a class we do not run (naming it and the classes we run),
    ``prompt_outputs_failed_validation`` with every node's faults.
    """
    if not isinstance(prompt, Mapping) or not prompt:
        raise WorkflowError(_shape_problem(prompt), type="invalid_prompt")
    if isinstance(prompt.get("nodes"), list) and "links" in prompt:
        raise WorkflowError(
            "this is ComfyUI's UI format (nodes and links); post the API format: "
            "'Export (API)' in ComfyUI's menu",
            type="invalid_prompt",
        )
    if len(prompt) > MAX_NODES:
        raise WorkflowError(
            f"the workflow has {len(prompt)} nodes; at most {MAX_NODES} here", type="invalid_prompt"
        )
    raw: dict[str, Mapping[str, Any]] = {}
    unknown: list[NodeError] = []
    for key, node in prompt.items():
        node_id = str(key)
        if not node_id or len(node_id) > _MAX_ID:
            raise WorkflowError(
                f"node id {node_id[:_MAX_ID]!r} is not one (1-{_MAX_ID} characters)", type="invalid_prompt"
            )
        if not isinstance(node, Mapping) or not isinstance(node.get("class_type"), str):
            raise WorkflowError(
                f"node {node_id} must be an object with a class_type, got {str(node)[:80]}",
                type="invalid_prompt",
            )
        class_type = node["class_type"]
        if class_type not in NODES:
            unknown.append(NodeError(node_id, class_type[:80], "node_not_accepted", _not_ours(class_type)))
        raw[node_id] = node
    if unknown:
        names = ", ".join(dict.fromkeys(e.class_type for e in unknown))
        raise WorkflowError(
            f"Cannot execute because node {names} does not exist here: this server runs "
            f"{', '.join(ACCEPTED)}",
            type="invalid_prompt",
            nodes=unknown,
        )
    faults: list[NodeError] = []
    nodes: dict[str, GraphNode] = {}
    for node_id, node in raw.items():
        inputs = node.get("inputs", {})
        meta = node.get("_meta")
        title = meta.get("title") if isinstance(meta, Mapping) else None
        schema = NODES[node["class_type"]]
        if not isinstance(inputs, Mapping):
            faults.append(NodeError(node_id, schema.name, "invalid_input_type", "inputs must be an object"))
            continue
        checked: dict[str, Any] = {}
        for spec in schema.required:
            problem = _check_input(spec, inputs, raw, node_id, schema)
            if isinstance(problem, NodeError):
                faults.append(problem)
            else:
                checked[spec.name] = problem
        nodes[node_id] = GraphNode(node_id, schema.name, checked, str(title or schema.display_name)[:80])
    if faults:
        raise WorkflowError(INVALID, nodes=faults)
    return Graph(nodes)


def _shape_problem(prompt: Any) -> str:
    if isinstance(prompt, Mapping):
        return "the workflow has no nodes"
    kind = "null" if prompt is None else type(prompt).__name__
    return f"prompt must be a workflow in API format (an object of nodes by id), got {kind}"


def _not_ours(class_type: str) -> str:
    return (
        f"node class {class_type[:80]!r} is not one this server runs; it runs {', '.join(ACCEPTED)} "
        "(GET /object_info)"
    )


def _check_input(
    spec: Input, inputs: Mapping[str, Any], raw: Mapping[str, Mapping[str, Any]], node_id: str, schema: Node
) -> Any:
    """The input's checked value (a Link for a linked one), or the NodeError saying what is wrong."""

    def fault(type: str, message: str) -> NodeError:
        return NodeError(node_id, schema.name, type, message, spec.name)

    if spec.name not in inputs:
        return fault("required_input_missing", f"Required input is missing: {spec.name}")
    value = inputs[spec.name]
    link = _as_link(value)
    if spec.linked:
        if link is None:
            return fault(
                "invalid_input_type", f"{spec.name} takes a link to a {spec.type} output, got {value!r:.60}"
            )
        source = raw.get(link.node_id)
        if source is None:
            return fault(
                "bad_linked_input", f"{spec.name} links to node {link.node_id}, which is not in the workflow"
            )
        outputs = NODES[source["class_type"]].outputs
        if not 0 <= link.output < len(outputs):
            return fault(
                "bad_linked_input",
                f"{spec.name} links to output {link.output} of node {link.node_id} "
                f"({source['class_type']}), which has {len(outputs)}",
            )
        given = outputs[link.output][0]
        if given != spec.type:
            return fault(
                "return_type_mismatch",
                f"Return type mismatch between linked nodes: {spec.name}, received_type({given}) "
                f"mismatch input_type({spec.type})",
            )
        return link
    if link is not None:
        return fault(
            "invalid_input_type", f"{spec.name} takes a value here, not a link to node {link.node_id}"
        )
    return _check_value(spec, value, fault)


def _check_value(spec: Input, value: Any, fault: Callable[[str, str], NodeError]) -> Any:
    if spec.type in ("STRING", "COMBO"):
        if not isinstance(value, str):
            return fault("invalid_input_type", f"{spec.name} must be a string, got {value!r:.60}")
        if isinstance(spec.choices, tuple) and value not in spec.choices:
            return fault(
                "value_not_in_list",
                f"Value not in list: {spec.name}: {value[:60]!r} not in {list(spec.choices)}",
            )
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return fault("invalid_input_type", f"{spec.name} must be a number, got {value!r:.60}")
    if spec.type == "INT":
        if value != int(value):
            return fault("invalid_input_type", f"{spec.name} must be an integer, got {value!r}")
        value = int(value)
    else:
        value = float(value)
    low, high = spec.options.get("min"), spec.options.get("max")
    if low is not None and value < low:
        return fault("value_smaller_than_min", f"Value {value} smaller than min of {low}: {spec.name}")
    if high is not None and value > high:
        return fault("value_bigger_than_max", f"Value {value} bigger than max of {high}: {spec.name}")
    return value


def _as_link(value: Any) -> Link | None:
    if (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], (str, int))
        and not isinstance(value[0], bool)
        and isinstance(value[1], int)
        and not isinstance(value[1], bool)
    ):
        return Link(str(value[0]), value[1])
    return None
