"""messages.py: our typed messages as ComfyUI's websocket frames, in ComfyUI's order."""

from __future__ import annotations

import json
import struct
from typing import Any

from omni_stream import protocol
from omni_stream.comfyui import (
    ModelCard,
    Plan,
    Translator,
    plan_workflow,
    preview_frame,
    read_workflow,
    status,
)
from omni_stream.params import Param

from .workflows import txt2img

CARD = ModelCard(
    "sd",
    {
        p.name: p
        for p in (
            Param("prompt", "str", ""),
            Param("negative_prompt", "str", ""),
            Param("steps", "int", 4),
            Param("seed", "int", 0),
            Param("guidance_scale", "float", 7.0),
            Param("width", "int", 16),
            Param("height", "int", 16),
            Param("sampler", "str", "euler", choices=("euler",)),
        )
    },
)
PLAN = plan_workflow(read_workflow(txt2img()), {"sd": CARD}, ())


def preview(step: int, *, final: bool = False, fmt: str = "jpeg") -> protocol.Preview:
    header = protocol.PreviewHeader("p", step, 2, final, fmt, 16, 16, f"image/{fmt}")
    return protocol.Preview.build(header, b"IMAGE%d" % step)


def frames(translator: Translator, *items: Any) -> list[Any]:
    out: list[Any] = []
    for item in items:
        out += [f if isinstance(f, bytes) else json.loads(f) for f in translator.frames(item)]
    return out


def kinds(found: list[Any]) -> list[str]:
    return ["binary" if isinstance(f, bytes) else f["type"] for f in found]


def test_a_request_is_comfyuis_messages_and_binary_previews_in_comfyuis_order() -> None:
    left = [1]
    translator = Translator({"p": PLAN}.get, lambda: left[0], clock=lambda: 12.5)
    accepted = protocol.Accepted.build("p", total=2, detach=True, attached=False, preview={})
    running = frames(
        translator,
        accepted,
        protocol.Progress.build("p", step=1, total=2, eta_s=1.0),
        preview(1),
        protocol.Progress.build("p", step=2, total=2, eta_s=0.0),
        preview(2, final=True, fmt="png"),
    )
    assert kinds(running) == [
        "status",
        "execution_start",
        "execution_cached",
        "executing",
        "progress",
        "binary",
        "progress",
        "binary",
    ]
    assert running[0]["data"] == {"status": {"exec_info": {"queue_remaining": 1}}}
    assert running[1]["data"] == {"prompt_id": "p", "timestamp": 12500}
    assert sorted(running[2]["data"]["nodes"]) == ["4", "5", "6", "7"]
    assert running[3]["data"] == {"node": "3", "display_node": "3", "prompt_id": "p"}
    assert running[4]["data"] == {"value": 1, "max": 2, "prompt_id": "p", "node": "3"}
    assert running[5] == struct.pack(">II", 1, 1) + b"IMAGE1" and running[7][:8] == struct.pack(">II", 1, 2)
    left[0] = 0
    ended = frames(translator, protocol.Done.build("p", total=2, elapsed_s=0.1))
    assert kinds(ended) == ["executing", "executing", "executed", "execution_success", "status", "executing"]
    assert [f["data"]["node"] for f in ended if f["type"] == "executing"] == ["8", "9", None]
    assert ended[2]["data"]["output"] == {
        "images": [{"filename": "ComfyUI_p_00001_.png", "subfolder": "", "type": "output"}]
    }
    assert ended[4]["data"] == {"status": {"exec_info": {"queue_remaining": 0}}}


def test_an_interrupted_or_failed_request_says_so_after_starting() -> None:
    translator = Translator({"p": PLAN}.get, lambda: 0)
    cancelled = frames(translator, protocol.Cancelled.build("p", reason="client"))
    assert kinds(cancelled) == [
        "execution_start",
        "execution_cached",
        "executing",
        "execution_interrupted",
        "status",
        "executing",
    ]
    assert cancelled[3]["data"]["node_id"] == "3" and cancelled[3]["data"]["node_type"] == "KSampler"
    failed = frames(translator, protocol.ErrorMessage.build("step_failed", "it broke", request_id="p"))
    error = next(f for f in failed if f["type"] == "execution_error")["data"]
    assert (error["exception_message"], error["exception_type"]) == ("it broke", "omni_stream.step_failed")
    forgotten = frames(
        Translator(lambda _: None, lambda: 0), protocol.Done.build("q", total=1, elapsed_s=0.1)
    )
    assert kinds(forgotten)[-3:] == ["execution_success", "status", "executing"]
    quiet = frames(
        translator, protocol.Loading.build("p", model="sd"), protocol.ErrorMessage.build("busy", "x")
    )
    assert quiet == []


def test_the_frames_themselves() -> None:
    assert preview_frame(b"abc", "png") == b"\0\0\0\1\0\0\0\2abc"
    assert preview_frame(b"abc", "webp") is None
    assert json.loads(status(3, sid="me")) == {
        "type": "status",
        "data": {"status": {"exec_info": {"queue_remaining": 3}}, "sid": "me"},
    }
    assert isinstance(PLAN, Plan)


def test_a_slow_reader_hears_the_latest_step_and_every_result_and_ending() -> None:
    # What a ComfyUI socket's writer drains: the core's outbox, fed by the request's record,
    # where a newer progress and preview replace those not yet sent (never a result or an end).
    from omni_stream.core.outbox import Outbox
    from omni_stream.core.records import RequestRecord

    record = RequestRecord("p", owner="call", detach=True, total=3, preview={}, created_at=0.0)
    outbox = Outbox(max_pending=16)
    record.watch("socket", outbox, attached=False)
    for step in (1, 2, 3):
        record.publish_progress(protocol.Progress.build("p", step=step, total=3, eta_s=0.0))
        if step < 3:
            record.publish_preview(preview(step))
    record.publish_preview(preview(3, final=True, fmt="png"))
    record.finish(protocol.Done.build("p", total=3, elapsed_s=0.1), now=1.0)
    translator = Translator({"p": PLAN}.get, lambda: 0)
    drained = []
    while (item := outbox.get_nowait()) is not None:
        drained += frames(translator, item.message)
    progress = [f["data"]["value"] for f in drained if isinstance(f, dict) and f["type"] == "progress"]
    binary = [f for f in drained if isinstance(f, bytes)]
    assert progress == [3] and len(binary) == 1 and binary[0][:8] == struct.pack(">II", 1, 2)
    assert kinds(drained)[-6:] == [
        "executing",
        "executing",
        "executed",
        "execution_success",
        "status",
        "executing",
    ]
