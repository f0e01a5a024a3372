"""What a workflow becomes: :class:`Plan`, one request and where each of its params came from (pure).

:func:`~omni_stream.comfyui.workflow.plan_workflow` makes a :class:`Plan`
from a checked workflow and the served models' :class:`ModelCard`; the
door turns it into the ``generate`` the core admits
(:meth:`Plan.to_generate`), names a node input when the core refuses one
of its params (:meth:`Plan.node_error`), and reads it back for the
websocket's messages and ``/history`` (the sampler, the outputs and their
file names, the nodes with no work of their own).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from .. import protocol
from ..models.diffusers import samplers
from ..params import Param
from .errors import NodeError
from .graph import GraphNode

__all__ = ["PREVIEW", "ModelCard", "Output", "Plan", "comfy_samplers"]

#: What previews a ComfyUI client gets: every step, as JPEG (ComfyUI's binary frame type 1).
PREVIEW: Final = {"format": "jpeg", "every": 1}


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What mapping needs of a served model: its name, its declared params, its LoRAs."""

    name: str
    params: Mapping[str, Param]
    loras: tuple[str, ...] = ()

    @classmethod
    def of(cls, name: str, model: Any) -> ModelCard:
        """The card of ``model`` (a StepModel) served as ``name``."""
        declared = {p.name: p for p in getattr(model, "params", ())}
        return cls(name, declared, tuple(getattr(model, "lora_names", ())))

    @property
    def samplers(self) -> tuple[str, ...]:
        """Our names of the samplers it offers (none when it does not choose one)."""
        param = self.params.get("sampler")
        return tuple(param.choices or ()) if param is not None else ()


@dataclass(frozen=True, slots=True)
class Output:
    """An output node: its id and class, where its images are listed (``output`` / ``temp``)."""

    node_id: str
    class_type: str
    kind: str
    prefix: str

    def filename(self, prompt_id: str, index: int, fmt: str) -> str:
        """Image ``index``'s name in ``/history`` and ``/view``: ComfyUI's ``PREFIX_00001_.png``
        with the prompt's id in it (a name is unique per prompt, and never a path)."""
        ext = {"jpeg": "jpg"}.get(fmt, fmt)
        return f"{self.prefix}_{prompt_id}_{index + 1:05}_.{ext}"


@dataclass(frozen=True, slots=True)
class Plan:
    """A workflow as one request: the model, its params, and where each came from.

    ``upload``: the ``LoadImage`` image (an upload's name) the door turns
    into ``image``; ``sources``: each of our param fields -> the node input
    it came from (``(node id, class, input)``), so a refusal of the core names
    the node; ``cached``: the nodes that run no work of their own
    (``execution_cached``).
    """

    model: str
    params: dict[str, Any]
    sampler: GraphNode
    outputs: tuple[Output, ...]
    decoders: tuple[str, ...]
    cached: tuple[str, ...]
    upload: str | None = None
    sources: Mapping[str, tuple[str, str, str]] = field(default_factory=dict)

    @property
    def output_ids(self) -> list[str]:
        return [o.node_id for o in self.outputs]

    def to_generate(self, prompt_id: str, image: str | None = None) -> protocol.Generate:
        """The ``generate`` the core admits: detached (a prompt runs whoever listens), JPEG previews
        every step, PNG results; ``image``: the upload as a ``data:`` URL, for img2img."""
        params = dict(self.params)
        if image is not None:
            params["image"] = image
        return protocol.Generate(
            id=prompt_id,
            params=params,
            preview=dict(PREVIEW),
            detach=True,
            output={"format": "png"},
            model=self.model,
        )

    def node_error(self, field: str | None, message: str, type: str = "value_not_valid") -> NodeError | None:
        """The core's refusal of our param ``field`` as the fault of the node input it came from."""
        if field is None:
            return None
        where = self.sources.get(field) or self.sources.get(field.split(".")[0])
        if where is None:
            return None
        node_id, class_type, input_name = where
        return NodeError(node_id, class_type, type, message, input_name)


def comfy_samplers(ours: Collection[str]) -> tuple[str, ...]:
    """ComfyUI's ``sampler_name`` for each of our sampler names (their Karras twins are
    ``scheduler: karras``): what ``/object_info`` lists for the models served."""
    return tuple(
        comfy for comfy, mine in samplers.COMFY_NAMES.items() if mine in ours or f"{mine}_karras" in ours
    )
