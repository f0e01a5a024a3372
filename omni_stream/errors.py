"""Every error omni_stream raises, in one tree.

.. code-block:: text

    OmniStreamError                  root of everything raised here
    ├── ParamsError (ValueError)     a request's params, or an option, are invalid (.field)
    │   └── MessageError             server: a client message it rejects (.code, the ``error``
    │       │                        code to answer with)
    │       └── ServerBusyError      server: a ``generate`` refused with ``busy`` (.retry_after_s)
    ├── LifecycleError (RuntimeError)  an Engine, EngineGroup, Server or Client started twice,
    │   │                            or used before it started or after it closed
    │   └── PoolClosedError          device: the host buffer pool closed under a waiting acquire()
    ├── RequestError                 one request ended badly; carries request_id
    │   ├── StepFailedError          the model raised; __cause__ is its exception
    │   ├── StepTimeoutError         a step's output did not arrive within the bound
    │   ├── RenderFailedError        a frame source that renders its own frames (a Ray replica)
    │   │                            could not render a preview or the result; __cause__ is why
    │   └── RequestCancelledError    engine.cancel(), a disconnect, or shutdown of that request
    ├── EngineError                  the engine itself cannot serve
    │   ├── EngineDeadError          its own machinery died; every request fails
    │   ├── EngineStalledError       one step has run longer than timeout()
    │   └── EngineClosedError        also LifecycleError: the engine was shut down (or never
    │                                started, or is started twice)
    ├── ServerFailedError            a task of the server failed, so it shut down; __cause__ is why
    ├── UnsupportedBackendError (RuntimeError)  used outside an asyncio (uvloop included) or
    │                            trio loop, or served under trio without hypercorn installed
    ├── CheckpointError (ValueError)  a request's state cannot be saved or restored: the model
    │                            cannot snapshot it, or a checkpoint is torn, tampered with, of
    │                            an unknown format or for another model
    ├── NonFiniteFrameError (ValueError)  preview: a frame holds NaN or infinite values, so
    │                            there is no picture to draw from it (a model that diverged)
    ├── StoreError                   the state directory (omni_stream.store) cannot be opened,
    │                                read or written: a newer schema, another process holds it,
    │                                a damaged database, a disk full or failing; __cause__ is why
    ├── OutboxOverflowError          server: a client stopped reading and its outbox went over
    │                                a bound (.limit); the server disconnects it
    ├── BodyRefused                  server: an HTTP request's body refused, too large (413
    │                                ``limit_exceeded``) or too slow (408 ``body_timeout``)
    │                                (.status, .code)
    ├── OpenAIError                  server, the OpenAI doors: a refusal in OpenAI's terms (.status,
    │                                .code, .param, .type, .retry_after_s; .body() is OpenAI's
    │                                error body)
    └── ClientError                  om.client: the server or the connection ended a call
        │                            (.code, the server's error code, and .field, where known)
        ├── ConnectError             the websocket could not be opened: refused, unreachable,
        │                            timed out, or the handshake refused (.status: 401, 403, 503)
        ├── ConnectionClosedError    the websocket closed under a request, or the client is
        │                            used after closing (.close_code, .close_reason)
        ├── ProtocolError            the server sent something docs/protocol.md does not allow
        ├── RequestRejectedError     an ``error`` rejecting generate / attach: nothing started
        │   ├── ParamsRejectedError  also ParamsError: bad_params, invalid_field, limit_exceeded
        │   └── BusyError            ``busy``: the server is too busy now (.retry_after_s)
        ├── RequestFailedError       also RequestError: an ``error`` ending an accepted request
        └── RemoteCancelledError     also RequestCancelledError: ``cancelled`` (.reason)

The client's errors are also the engine's where the meaning is the same,
so code written against ``engine.stream()`` reads the same remotely.
LifecycleError is a RuntimeError because that is what a Server or Client
started twice raised before it existed.
The caller's own cancellation (``asyncio.CancelledError`` and anyio's
cancel scopes) is never wrapped in, or swallowed by, any of these.
Every error raised while serving a request carries its ``request_id``.

Every error here survives ``pickle`` (a process pool, a Ray replica) with its
message, ``request_id``, its other attributes and its ``__cause__`` chain. A
cause that cannot make the trip (an exception holding a lock, or one whose
``__init__`` takes arguments its ``args`` do not hold) arrives as a plain
``Exception`` naming its type and message, rather than failing the whole
unpickle on the far side.
"""

from __future__ import annotations

import pickle
from typing import Any

__all__ = [
    "OmniStreamError",
    "ParamsError",
    "MessageError",
    "ServerBusyError",
    "LifecycleError",
    "PoolClosedError",
    "RequestError",
    "StepFailedError",
    "StepTimeoutError",
    "RenderFailedError",
    "RequestCancelledError",
    "EngineError",
    "EngineDeadError",
    "EngineStalledError",
    "EngineClosedError",
    "ServerFailedError",
    "UnsupportedBackendError",
    "CheckpointError",
    "NonFiniteFrameError",
    "StoreError",
    "OutboxOverflowError",
    "BodyRefused",
    "OpenAIError",
    "ClientError",
    "ConnectError",
    "ConnectionClosedError",
    "ProtocolError",
    "RequestRejectedError",
    "ParamsRejectedError",
    "BusyError",
    "RequestFailedError",
    "RemoteCancelledError",
]


class OmniStreamError(Exception):
    """Root of every error omni_stream raises.

    ``request_id`` names the request being served when the error arose, or
    is ``None`` where there is none (engine-wide errors raised outside any
    request, bad options).
    """

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id

    def __str__(self) -> str:
        if self.request_id is None:
            return self.message
        return f"[request {self.request_id}] {self.message}"

    # Pickling. The default (``type(self)(*self.args)`` then the __dict__)
    # fails for subclasses with required keyword-only arguments (step,
    # bound_s, reason) and drops ``__cause__`` for every exception: both
    # matter once errors cross a process boundary. Rebuilt without calling
    # ``__init__``, so no subclass has to keep its signature in step.

    def __reduce__(self) -> tuple[Any, ...]:
        state = dict(self.__dict__)
        state[_CHAIN] = _portable_chain(self.__cause__)
        state[_SUPPRESS] = self.__suppress_context__
        return (_rebuild, (type(self), self.args), state)

    def __setstate__(self, state: dict[str, Any] | None) -> None:
        attrs = dict(state or {})
        chain: tuple[BaseException, ...] = attrs.pop(_CHAIN, ())
        suppress = bool(attrs.pop(_SUPPRESS, bool(chain)))
        self.__dict__.update(attrs)
        # Foreign exceptions pickle without their own __cause__: relink them.
        # The last link may be one of ours, which carried its own chain.
        for exc, cause in zip(chain, chain[1:], strict=False):
            exc.__cause__ = cause
        self.__cause__ = chain[0] if chain else None
        self.__suppress_context__ = suppress


# Keys of the pickled state that are not attributes.
_CHAIN = "__cause_chain__"
_SUPPRESS = "__suppress_context__"


def _rebuild(cls: type[OmniStreamError], args: tuple[Any, ...]) -> OmniStreamError:
    return cls.__new__(cls, *args)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip, else a plain Exception saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception as why:  # any failure to pickle or to rebuild
        kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        stand_in = Exception(f"{kind}: {exc} (the original could not be pickled: {why!r})")
        stand_in.__suppress_context__ = True
        return stand_in
    return exc


def _portable_chain(cause: BaseException | None) -> tuple[BaseException, ...]:
    """The ``__cause__`` chain from ``cause``, up to and including our first error in it."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OmniStreamError):
            chain.append(cause)  # its own __reduce__ carries the rest
            break
        chain.append(_portable(cause))
        cause = cause.__cause__
    return tuple(chain)


class ParamsError(OmniStreamError, ValueError):
    """A request's params (or an engine option) are invalid.

    ``field`` names the offending parameter where one can be named.
    """

    def __init__(self, message: str, *, field: str | None = None, request_id: str | None = None) -> None:
        super().__init__(message, request_id=request_id)
        self.field = field


class MessageError(ParamsError):
    """A client message the server rejects; ``code`` is the ``error`` code to send.

    ``field`` names the offending field and ``request_id`` the request the
    message named, where known.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        field: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message, field=field, request_id=request_id)
        self.code = code


class ServerBusyError(MessageError):
    """A ``generate`` refused with ``busy``; ``retry_after_s`` says when to try again."""

    def __init__(self, message: str, *, retry_after_s: float, request_id: str | None = None) -> None:
        super().__init__("busy", message, request_id=request_id)
        self.retry_after_s = retry_after_s


class LifecycleError(OmniStreamError, RuntimeError):
    """Used in the wrong state: started twice, or used before it started or after it closed.

    Raised by an Engine (as EngineClosedError), an EngineGroup, a Server and
    a Client (see ``omni_stream.lifecycle``), and by a Store
    (``omni_stream.store``) used after ``close``.
    """


class PoolClosedError(LifecycleError):
    """``PinnedBufferPool.acquire`` was interrupted because the pool was closed."""


class RequestError(OmniStreamError):
    """One request ended without its final frame."""


class StepFailedError(RequestError):
    """The model raised while computing a step; ``__cause__`` is its exception."""

    def __init__(self, message: str, *, request_id: str | None, step: int) -> None:
        super().__init__(message, request_id=request_id)
        self.step = step


class StepTimeoutError(RequestError):
    """A step's output did not arrive within the bound (see ``omni_stream.timeout``)."""

    def __init__(self, message: str, *, request_id: str | None, step: int, bound_s: float) -> None:
        super().__init__(message, request_id=request_id)
        self.step = step
        self.bound_s = bound_s


class RenderFailedError(RequestError):
    """Rendering a frame where it was made (a preview, or the result) failed; ``__cause__`` is why.

    Raised by frame sources that render for a server (``preview.RenderRequest``),
    such as a Ray replica; a server answers it with ``preview_failed``.
    """

    def __init__(self, message: str, *, request_id: str | None, step: int) -> None:
        super().__init__(message, request_id=request_id)
        self.step = step


class RequestCancelledError(RequestError):
    """The request was cancelled by ``engine.cancel()`` or by its stream being dropped."""


class EngineError(OmniStreamError):
    """The engine cannot serve (any request)."""


class EngineDeadError(EngineError):
    """The engine's own machinery died; ``__cause__`` is what killed it."""


class EngineStalledError(EngineError):
    """One step has been running on the accelerator longer than ``timeout()``."""


class EngineClosedError(EngineError, LifecycleError):
    """The engine was shut down, was used outside ``async with``, or was started twice."""


class ServerFailedError(OmniStreamError):
    """A task of the server itself failed, so it shut down; ``__cause__`` is what that task raised."""


class UnsupportedBackendError(OmniStreamError, RuntimeError):
    """Used outside the async libraries it runs on (``omni_stream._backend``).

    The engine, the client and the server run on anyio's asyncio (uvloop
    included) and trio backends; the server under trio on hypercorn (the
    ``trio`` extra), and this error when it is not installed. A
    RuntimeError, as what they raised there before.
    """


class CheckpointError(OmniStreamError, ValueError):
    """A request's state cannot be saved or restored (``omni_stream.checkpoint``).

    Raised by ``StepModel.snapshot`` for a request whose state cannot be
    captured exactly (callback mode, a sampler whose noise lives outside
    the request's generator), by ``Checkpoint.from_bytes`` for bytes that
    are torn, tampered with or of an unknown format version, and by
    ``StepModel.restore`` for a checkpoint of another model or of a state
    format it does not read. A ValueError: the data is what is wrong.
    """


class NonFiniteFrameError(OmniStreamError, ValueError):
    """A frame holds NaN or infinite values: there is no picture to draw from it.

    Raised by ``preview.check_finite`` (and ``render_sync(..., finite=True)``);
    the server skips such a preview and fails such a result. A ValueError, as
    it was before it joined this tree: the data is what is wrong.
    """


class StoreError(OmniStreamError):
    """The state directory cannot be opened, read or written (``omni_stream.store``).

    Its message names the folder and says what to do. Raised by
    ``Store.open`` for a database of a newer schema version, one that is
    damaged, or a folder another process holds; by any store method for an
    OSError or a SQLite error (a full or failing disk), which is its
    ``__cause__``. Bad data in a checkpoint or a result file is not an
    error: the store reports it as missing and logs a warning.
    """


class OutboxOverflowError(OmniStreamError):
    """A client's outbox overflowed; ``limit`` names the bound it went over.

    ``max_pending`` or ``max_pending_bytes`` (the client is not reading), or
    ``max_memory_bytes`` (the server's memory budget closed it).
    """

    def __init__(self, message: str, *, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class BodyRefused(OmniStreamError):
    """An HTTP request's body is refused (``server/bodies.py``): too large, or too slow.

    ``status`` is the HTTP status to answer with (413, 408), ``code`` the
    ``error`` code (``limit_exceeded``, ``body_timeout``).
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class OpenAIError(OmniStreamError):
    """A refusal on an OpenAI door, in OpenAI's terms (``omni_stream.openai.errors``).

    ``status`` is the HTTP status, ``code`` ours (its meaning kept),
    ``param`` the field at fault, ``type`` OpenAI's error type;
    ``retry_after_s`` (429 / 503) becomes ``Retry-After``.
    """

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.type = type
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        """OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``.

        The same shape as ``omni_stream.openai.errors.error_body``, which
        builds it for answers that are not raised; it is OpenAI's, not ours
        to change.
        """
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientError(OmniStreamError):
    """The server or the connection ended a client call.

    ``code`` is the server's ``error`` code (or the handshake's, for
    ConnectError) where there is one; ``field`` names the field at fault.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        field: str | None = None,
        request_id: str | None = None,
    ) -> None:
        # Explicit, not super(): subclasses also derive from ParamsError or
        # RequestError, whose own __init__ signatures differ.
        OmniStreamError.__init__(self, message, request_id=request_id)
        self.code = code
        self.field = field


class ConnectError(ClientError):
    """The websocket could not be opened; ``status`` is the HTTP status of a refused handshake."""

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message, code=code)
        self.status = status


class ConnectionClosedError(ClientError):
    """The websocket closed while a request was in flight, or the client was used after closing."""

    def __init__(
        self,
        message: str,
        *,
        close_code: int | None = None,
        close_reason: str = "",
        request_id: str | None = None,
    ) -> None:
        super().__init__(message, request_id=request_id)
        self.close_code = close_code
        self.close_reason = close_reason


class ProtocolError(ClientError):
    """The server sent a message or frame that docs/protocol.md does not allow."""


class RequestRejectedError(ClientError):
    """The server rejected a ``generate`` or ``attach``; nothing was started."""


class ParamsRejectedError(RequestRejectedError, ParamsError):
    """The server rejected the request's params or fields; ``field`` names the one at fault."""


class BusyError(RequestRejectedError):
    """The server is too busy to take the request (``busy``); nothing was started.

    ``retry_after_s`` is the server's estimate of when to try again
    (None when it gave none).
    """

    def __init__(
        self, message: str, *, retry_after_s: float | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(message, code="busy", request_id=request_id)
        self.retry_after_s = retry_after_s


class RequestFailedError(ClientError, RequestError):
    """The server ended an accepted request with an ``error`` (step_failed, step_timeout, ...)."""


class RemoteCancelledError(ClientError, RequestCancelledError):
    """The request was cancelled; ``reason`` is client, disconnect, shutdown or engine."""

    def __init__(self, message: str, *, reason: str, request_id: str | None = None) -> None:
        super().__init__(message, code="cancelled", request_id=request_id)
        self.reason = reason
