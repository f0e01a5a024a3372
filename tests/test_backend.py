"""_backend.py: which library runs the loop, the thread-to-loop call on each, the asyncio-only check."""

from __future__ import annotations

import threading

import anyio
import pytest

from omni_stream import _backend
from omni_stream.errors import OmniStreamError, UnsupportedBackendError

from .conftest import ANYIO_BACKENDS

BACKENDS = ANYIO_BACKENDS


@pytest.mark.anyio
async def test_the_backend_is_named_as_anyio_names_it(anyio_backend) -> None:
    assert _backend.current_backend() == anyio_backend[0]


def test_outside_a_loop_there_is_no_backend_and_no_loop_to_call() -> None:
    assert _backend.current_backend() is None
    with pytest.raises(UnsupportedBackendError, match="outside any event loop"):
        _backend.running_loop()


@pytest.mark.anyio
async def test_calls_from_threads_run_on_the_loop_in_the_order_they_were_made(anyio_backend) -> None:
    loop = _backend.running_loop()
    here = threading.get_ident()
    ran: list[tuple[int, int]] = []
    done = anyio.Event()

    def record(i: int) -> None:
        ran.append((i, threading.get_ident()))
        if i == 199:
            done.set()

    def post_all() -> None:
        for i in range(200):
            loop.call_soon_threadsafe(record, i)

    await anyio.to_thread.run_sync(post_all)
    with anyio.fail_after(10):
        await done.wait()
    assert [i for i, _ in ran] == list(range(200))  # the copier relies on this order
    assert {thread for _, thread in ran} == {here}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_after_the_loop_finished_raises_a_runtime_error(backend) -> None:
    # What the engine's threads suppress when the loop is gone.
    async def grab() -> _backend.ThreadsafeLoop:
        return _backend.running_loop()

    name, options = backend
    loop = anyio.run(grab, backend=name, backend_options=options)
    with pytest.raises(RuntimeError):
        loop.call_soon_threadsafe(print, "never")


@pytest.mark.anyio
async def test_require_asyncio_passes_on_asyncio_and_refuses_trio(anyio_backend) -> None:
    if anyio_backend[0] == "asyncio":
        _backend.require_asyncio("the part")
        return
    with pytest.raises(UnsupportedBackendError) as info:
        _backend.require_asyncio("the part")
    message = str(info.value)
    assert message.startswith("the part needs anyio's asyncio backend") and "under trio" in message
    assert isinstance(info.value, OmniStreamError) and isinstance(info.value, RuntimeError)
