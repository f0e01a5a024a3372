"""The omni_stream benchmark suite: every figure a ratio against a baseline run beside it.

``python -m benchmarks [--quick] [--only NAME ...] [--json out.json] [--markdown]``
runs it; ``docs/performance.md`` explains each figure. The figures, by name:

``limit``      the engine against the same steps in a bare loop (main thread, worker thread)
``threads``    where torch compute runs: OpenMP teams in the main and worker threads
``naive``      the callback + thread + inline preview pattern users write today, against the engine
``handover``   the thread-and-queue streaming users write by hand, and a bare worker loop, against the engine
``overlap``    per-step time on a simulated accelerator against max(compute, copy)
``batching``   16 concurrent requests against the same 16 one at a time
``loop_lag``   event-loop lag while 64 requests stream
``fanout``     100 websocket clients through the server, against a ComfyUI-style publish loop
``memory``     RSS after 1,000 requests against after 100, and a reader that never reads
``diffusers_stream``  a random SD pipeline streamed (native, callback, TAESD previews) against ``pipe()``
``diffusers_batching``  4 and 16 concurrent requests on that pipeline, batched, unbatched, one at a time
``diffusers_models``  switching between two models under max_loaded=1; num_images=4 against 4 requests
``checkpoints``  what a checkpoint every 10 steps costs a request, and a resumed request's first frame
``crash``      kill -9 of a real ``serve --state-dir`` mid-render: steps redone, restart to the first resumed frame
``scheduling``  short requests among long ones under round-robin, fcfs and preemptive scheduling
``server_scheduling``  the same through a real server whose places long renders hold: the gate's preemption
``openai_door``  POST /v1/images/generations against POST /v1/generations, the same image; streamed partials
``step_shapes``  the GPU's step shapes on the simulated GPU: engine against a bare loop and the hand-written peer
"""

from __future__ import annotations

# Nothing heavy is imported here: ``python -m benchmarks.fanout_client`` (the
# load generator's process) must start without torch.

__all__ = ["FIGURES"]

#: Figure name -> the module whose ``async run(ctx) -> list[Figure]`` measures it.
FIGURES: dict[str, str] = {
    "limit": "benchmarks.limit",
    "threads": "benchmarks.threads",
    "naive": "benchmarks.naive",
    "handover": "benchmarks.handover",
    "overlap": "benchmarks.overlap",
    "batching": "benchmarks.batching",
    "loop_lag": "benchmarks.loop_lag",
    "fanout": "benchmarks.fanout",
    "memory": "benchmarks.memory",
    "diffusers_stream": "benchmarks.diffusers_stream",
    "diffusers_batching": "benchmarks.diffusers_batching",
    "diffusers_models": "benchmarks.diffusers_models",
    "openai_door": "benchmarks.openai_door",
    "scheduling": "benchmarks.scheduling",
    "checkpoints": "benchmarks.checkpoints",
    "crash": "benchmarks.crash",
    "server_scheduling": "benchmarks.server_scheduling",
    "step_shapes": "benchmarks.step_shapes",
}
