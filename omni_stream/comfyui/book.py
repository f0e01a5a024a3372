"""The ComfyUI door's prompts: who posted which, for which client, and their history (pure).

A posted prompt is a detached request of the core (it runs whoever
listens, and its results are kept ``retention_s``); :class:`PromptBook`
keeps, beside its record, what ComfyUI's routes answer with: its number,
its workflow and ``extra_data`` (``/queue``, ``/history``'s ``prompt``), its
:class:`~omni_stream.comfyui.plan.Plan` (the node ids of every message), the
``client_id`` whose websockets hear it, and its *owner*: the principal that
posted it (its token's name, else its address; core/principal.py). Every
route answers an owner its own prompts only: ``/history``, ``/view``,
``/queue``, ``/interrupt``; another's id is not found.

Bounded by the core: an entry lives as long as the registry keeps its
record (``alive``; detached requests are at most ``max_retained``, ended
ones forgotten after ``retention_s`` or under memory pressure), and is
pruned on every change. Each entry's workflow counts in the server's memory
budget while it is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .. import protocol
from .plan import Output, Plan

if TYPE_CHECKING:
    from ..core.records import RequestRecord

__all__ = ["Prompt", "PromptBook"]


class _Budget(Protocol):
    def add(self, n: int) -> None: ...
    def release(self, n: int) -> None: ...


@dataclass(eq=False)
class Prompt:
    """One posted prompt: its record in the core, and what ComfyUI's routes say of it."""

    id: str
    number: int
    owner: str
    client_id: str | None
    plan: Plan
    record: RequestRecord
    workflow: Mapping[str, Any] = field(repr=False)
    extra_data: Mapping[str, Any] = field(default_factory=dict, repr=False)
    #: Bytes of the workflow as posted, counted in the memory budget while kept.
    size: int = 0
    created_ms: int = 0

    def queue_item(self) -> list[Any]:
        """ComfyUI's queue entry: ``[number, prompt_id, prompt, extra_data, outputs_to_execute]``."""
        return [self.number, self.id, self.workflow, self.extra_data, self.plan.output_ids]

    def files(self) -> Iterator[tuple[Output, int, str]]:
        """Each result as each output node lists it: ``(output, index, filename)``."""
        record = self.record
        for output in self.plan.outputs:
            for index in range(record.result_count):
                result = record.result(index)
                assert result is not None  # index < result_count
                yield output, index, output.filename(self.id, index, result.header.format)

    def history(self) -> dict[str, Any]:
        """ComfyUI's history entry (an ended prompt): its prompt, outputs, status and nodes."""
        outputs: dict[str, dict[str, list[dict[str, str]]]] = {}
        for output, _, name in self.files():
            images = outputs.setdefault(output.node_id, {"images": []})["images"]
            images.append({"filename": name, "subfolder": "", "type": output.kind})
        terminal = self.record.terminal_message()
        stamp = {"prompt_id": self.id, "timestamp": self.created_ms}
        messages: list[list[Any]] = [["execution_start", stamp]]
        sampler = self.plan.sampler
        if isinstance(terminal, protocol.Done):
            status, messages = "success", [*messages, ["execution_success", stamp]]
        elif isinstance(terminal, protocol.ErrorMessage):
            node = {"node_id": sampler.id, "node_type": sampler.class_type}
            error = {
                **stamp,
                **node,
                "exception_message": terminal.message,
                "exception_type": f"omni_stream.{terminal.code}",
            }
            status, messages = "error", [*messages, ["execution_error", error]]
        else:
            node = {"node_id": sampler.id, "node_type": sampler.class_type}
            status, messages = "error", [*messages, ["execution_interrupted", {**stamp, **node}]]
        meta = {
            node_id: {
                "node_id": node_id,
                "display_node": node_id,
                "parent_node": None,
                "real_node_id": node_id,
            }
            for node_id in outputs
        }
        return {
            "prompt": self.queue_item(),
            "outputs": outputs,
            "status": {"status_str": status, "completed": status == "success", "messages": messages},
            "meta": meta,
        }


class PromptBook:
    """Every prompt the door knows, by id (see the module docstring).

    ``alive(prompt)``: whether the core still keeps its record; ``budget``:
    where its workflow's bytes are counted (None: nowhere).
    """

    def __init__(self, alive: Callable[[Prompt], bool], *, budget: _Budget | None = None) -> None:
        self._alive = alive
        self._budget = budget
        self._prompts: dict[str, Prompt] = {}
        self._number = 0

    def __len__(self) -> int:
        return len(self._prompts)

    def next_number(self) -> int:
        """The next prompt's number (ComfyUI's queue order)."""
        self._number += 1
        return self._number

    def add(self, prompt: Prompt) -> None:
        self.prune()
        self._prompts[prompt.id] = prompt
        if self._budget is not None:
            self._budget.add(prompt.size)

    def get(self, prompt_id: str, owner: str) -> Prompt | None:
        """``owner``'s prompt ``prompt_id``; None for another's, or one forgotten."""
        self.prune()
        found = self._prompts.get(prompt_id)
        return found if found is not None and found.owner == owner else None

    def plan(self, prompt_id: str) -> Plan | None:
        """The plan of prompt ``prompt_id``, whoever's (for the messages of a socket that watches it)."""
        found = self._prompts.get(prompt_id)
        return None if found is None else found.plan

    def of(self, owner: str) -> list[Prompt]:
        """``owner``'s prompts, oldest first."""
        self.prune()
        return [p for p in self._prompts.values() if p.owner == owner]

    def running(self, owner: str, client_id: str | None = None) -> list[Prompt]:
        """``owner``'s prompts not yet ended (of ``client_id`` only, when given)."""
        return [
            p
            for p in self.of(owner)
            if not p.record.ended and (client_id is None or p.client_id == client_id)
        ]

    def remaining(self, owner: str) -> int:
        """``status``'s ``queue_remaining`` for ``owner``: its prompts not yet ended."""
        return sum(1 for p in self._prompts.values() if p.owner == owner and not p.record.ended)

    def find_file(self, owner: str, filename: str, kind: str) -> tuple[Prompt, int] | None:
        """The prompt and result index ``owner``'s ``filename`` of ``kind`` (output, temp) names."""
        for prompt in self.of(owner):
            for output, index, name in prompt.files():
                if name == filename and output.kind == kind:
                    return prompt, index
        return None

    def prune(self) -> None:
        """Forget the prompts whose records the core forgot."""
        gone = [p for p in self._prompts.values() if not self._alive(p)]
        for prompt in gone:
            del self._prompts[prompt.id]
            if self._budget is not None:
                self._budget.release(prompt.size)
