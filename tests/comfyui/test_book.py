"""book.py: prompts by owner, ComfyUI's history and queue entries, pruned with their records."""

from __future__ import annotations

from omni_stream import protocol
from omni_stream.comfyui import Prompt, PromptBook
from omni_stream.core.records import RequestRecord

from .test_messages import PLAN


class Budget:
    def __init__(self) -> None:
        self.held = 0

    def add(self, n: int) -> None:
        self.held += n

    def release(self, n: int) -> None:
        self.held -= n


def prompt(book: PromptBook, prompt_id: str, owner: str, client_id: str | None = "c") -> Prompt:
    record = RequestRecord(prompt_id, owner="call", detach=True, total=2, preview={}, created_at=0.0)
    entry = Prompt(
        prompt_id,
        book.next_number(),
        owner,
        client_id,
        PLAN,
        record,
        {"3": {}},
        {"x": 1},
        size=100,
        created_ms=7,
    )
    book.add(entry)
    return entry


def finish(entry: Prompt, message: protocol.ServerMessage) -> None:
    header = protocol.PreviewHeader(entry.id, 2, 2, True, "png", 16, 16, "image/png")
    if isinstance(message, protocol.Done):
        entry.record.publish_preview(protocol.Preview.build(header, b"PNG"))
    entry.record.finish(message, now=1.0)  # type: ignore[arg-type]


def test_each_owner_sees_its_own_prompts_only_and_their_files() -> None:
    alive: set[str] = {"p1", "p2", "p3"}
    budget = Budget()
    book = PromptBook(lambda p: p.id in alive, budget=budget)
    mine, other, later = (
        prompt(book, "p1", "token:a"),
        prompt(book, "p2", "token:b"),
        prompt(book, "p3", "token:a", "d"),
    )
    assert (mine.number, other.number, later.number) == (1, 2, 3) and budget.held == 300
    assert book.get("p1", "token:a") is mine and book.get("p1", "token:b") is None
    assert [p.id for p in book.running("token:a", "c")] == ["p1"] and book.remaining("token:a") == 2
    finish(mine, protocol.Done.build("p1", total=2, elapsed_s=0.1))
    assert book.remaining("token:a") == 1 and book.plan("p1") is PLAN
    assert book.find_file("token:a", "ComfyUI_p1_00001_.png", "output") == (mine, 0)
    assert book.find_file("token:b", "ComfyUI_p1_00001_.png", "output") is None
    assert book.find_file("token:a", "ComfyUI_p1_00001_.png", "temp") is None
    alive.discard("p1")  # the core forgot its record: so does the book, and its bytes
    assert book.of("token:a") == [later] and budget.held == 200 and len(book) == 2


def test_history_is_comfyuis_entry_for_each_way_a_prompt_ends() -> None:
    book = PromptBook(lambda p: True)
    done, failed, stopped = prompt(book, "d", "o"), prompt(book, "f", "o"), prompt(book, "s", "o")
    finish(done, protocol.Done.build("d", total=2, elapsed_s=0.1))
    finish(failed, protocol.ErrorMessage.build("step_failed", "it broke", request_id="f"))
    finish(stopped, protocol.Cancelled.build("s", reason="client"))
    entry = done.history()
    assert entry["prompt"] == [1, "d", {"3": {}}, {"x": 1}, ["9"]]
    assert entry["outputs"] == {
        "9": {"images": [{"filename": "ComfyUI_d_00001_.png", "subfolder": "", "type": "output"}]}
    }
    assert entry["status"] == {
        "status_str": "success",
        "completed": True,
        "messages": [
            ["execution_start", {"prompt_id": "d", "timestamp": 7}],
            ["execution_success", {"prompt_id": "d", "timestamp": 7}],
        ],
    }
    assert entry["meta"]["9"]["node_id"] == "9"
    error = failed.history()["status"]
    assert error["status_str"] == "error" and error["messages"][-1][0] == "execution_error"
    assert error["messages"][-1][1]["exception_type"] == "omni_stream.step_failed"
    assert stopped.history()["status"]["messages"][-1][0] == "execution_interrupted"
    assert failed.history()["outputs"] == {} and stopped.queue_item()[1] == "s"
