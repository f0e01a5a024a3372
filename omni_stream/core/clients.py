"""The rules' clients: who connects, at which door, as whom, and what each may hold.

A :class:`Client` is one session at a door (a websocket connection, an
HTTP call, an event stream); :class:`Clients`, a part of
:class:`~omni_stream.core.rules.Rules`, registers and forgets them: their
principal (a token's, else the connection or the address, principal.py),
the refusal of one more (:meth:`Clients.connection_refusal`: the server's
``max_connections`` and each principal's share), their outbox, the rate
of their messages (per principal, rates.py) and what ends when one goes
(its own requests that are not detached). Sans-I/O like the rest of the
rules: a door calls these as a client comes and goes, and the answer is a
value (a :class:`Refusal`, a delay in seconds) the door acts on. Its own
module so that connection bookkeeping reads apart from what the clients'
messages do; and what a client may see (:meth:`Clients.lookup`: its own,
its proved principal's, its browser session's, a detached request's by
id) and watch (:meth:`Clients.attach`).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from .. import protocol
from .outbox import Outbox
from .principal import Principal
from .rates import message_cost

if TYPE_CHECKING:
    from .effects import Shell
    from .limits import ServerLimits
    from .memory import MemoryBudget
    from .metrics import ServerMetrics
    from .rates import RateBook
    from .records import RequestRecord
    from .registry import RequestRegistry
    from .tokens import Tokens

__all__ = ["Client", "Clients", "Refusal", "who"]


@dataclasses.dataclass(eq=False)
class Client:
    """One client session at a door: a websocket connection, an HTTP call, an event stream.

    ``id`` is unique to the session (it owns the requests it starts that
    are not detached); ``principal`` is who it is (what the rules count by);
    ``outbox`` is where its replies go (None for an HTTP call, which reads
    its answer from the call's return value).
    """

    id: str
    principal: Principal
    door: str
    outbox: Outbox | None = None
    #: It started a request that is not detached (which ends when it goes).
    owns_attached: bool = False
    #: The browser session it came with, without a token (server/sessions.py): the
    #: requests started in it are that session's to see, never counted by it.
    session: str | None = None
    #: Whether ``session`` came with it (a browser keeping its cookie) rather than being given
    #: to it now: only such a session scopes its repeats (core/repeats.py), or a caller without
    #: a cookie jar would be a new one each call.
    session_returned: bool = False

    @property
    def repeat_session(self) -> str | None:
        """The session whose repeats its requests share (:func:`~.repeats.repeat_scope`)."""
        return self.session if self.session_returned else None


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """Why a new client (connection) is refused: the HTTP status, the code, the words."""

    status: int
    code: str
    message: str


class Clients:
    """Clients coming and going: a part of :class:`~omni_stream.core.rules.Rules` (see the module
    docstring), whose ``__init__`` sets these attributes."""

    tokens: Tokens
    limits: ServerLimits
    clock: Callable[[], float]
    closing: bool
    #: Open clients (websockets, HTTP calls, event streams), by id.
    clients: dict[str, Client]
    #: Open clients per principal key.
    open_by_principal: Counter[str]
    metrics: ServerMetrics
    memory: MemoryBudget
    registry: RequestRegistry
    rates: RateBook
    shell: Shell | None

    if TYPE_CHECKING:

        def stop(self, record: RequestRecord, reason: str) -> None: ...

        def position_of(self, record: RequestRecord) -> int | None: ...

    def principal_of_connection(self, conn_id: str, *, headers: Mapping[str, str], query: str) -> Principal:
        """A websocket's principal: its token's, else the connection (see principal.py)."""
        grant = self.tokens.identify(headers, query) if self.tokens else None
        return Principal.of_token(grant) if grant is not None else Principal.of_connection(conn_id)

    def principal_of_address(self, address: str, *, headers: Mapping[str, str], query: str) -> Principal:
        """An HTTP caller's principal: its token's, else its address (see principal.py)."""
        grant = self.tokens.identify(headers, query) if self.tokens else None
        return Principal.of_token(grant) if grant is not None else Principal.of_address(address)

    def connection_refusal(self, principal: Principal) -> Refusal | None:
        """Why a new client of ``principal`` is refused now; None to accept."""
        if self.closing:
            return Refusal(503, "shutting_down", "the server is shutting down")
        limits = self.limits
        if len(self.clients) >= limits.max_connections:
            return Refusal(
                503,
                "too_many_connections",
                f"the server has {limits.max_connections} connections open "
                "(max_connections, OMNI_STREAM_MAX_CONNECTIONS)",
            )
        if self.open_by_principal[principal.key] >= limits.max_connections_per_principal:
            return Refusal(
                429,
                "too_many_connections",
                f"{who(principal)} already has {limits.max_connections_per_principal} connections "
                "open, HTTP calls and event streams included (max_connections_per_principal, "
                "OMNI_STREAM_MAX_CONNECTIONS_PER_PRINCIPAL)",
            )
        return None

    def connect(self, principal: Principal, door: str, *, watching: bool = False) -> Client:
        """Register a new client (call :meth:`connection_refusal` first); returns it, with an
        outbox (:meth:`open_outbox`) when it is ``watching`` from the start (a websocket)."""
        client = Client(uuid.uuid4().hex, principal, door)
        if watching:
            self.open_outbox(client)
        if principal.kind == "connection" and principal.name != client.id:
            # A websocket without a token is its own principal: one name for both.
            client.principal = Principal.of_connection(client.id)
        self.clients[client.id] = client
        self.open_by_principal[client.principal.key] += 1
        self.metrics.connections.inc()
        self.metrics.connections_opened.inc()
        return client

    def open_outbox(self, client: Client, *, on_overflow: Callable[[], None] | None = None) -> Outbox:
        """Give ``client`` its outbox, bounded by the server's limits and its memory budget, its
        drops counted (an HTTP call gets one when it starts watching a request: events, a wait)."""
        limits, metrics = self.limits, self.metrics
        client.outbox = Outbox(
            max_pending=limits.max_pending,
            max_pending_bytes=limits.max_pending_bytes,
            budget=self.memory,
            on_replaced=lambda kind: metrics.messages_dropped.labels(kind).inc(),
            on_overflow=on_overflow,
        )
        return client.outbox

    def disconnect(self, client: Client) -> None:
        """The client is gone: nothing more is sent to it; its own requests that are not detached end."""
        if client.outbox is not None or client.owns_attached:
            # (A client without an outbox watched nothing, and if all it
            # started is detached, nothing ends with it: an HTTP call's close
            # is then no walk over every record.)
            for record in self.registry.disconnect(client.id):
                self.stop(record, "disconnect")
        if self.clients.pop(client.id, None) is not None:
            key = client.principal.key
            self.open_by_principal[key] -= 1
            if self.open_by_principal[key] <= 0:
                del self.open_by_principal[key]
                self.rates.forget(key, self.clock())
            self.metrics.connections.dec()
        if not self.clients and self.shell is not None:
            self.shell.clients_idle()

    def pace(self, client: Client, nbytes: int) -> float:
        """Count one message of ``nbytes`` against its principal's rate; seconds to wait before acting.

        max_messages_per_s per principal, in bursts of as many (rates.py):
        the door reads (or answers) the next one that much later.
        """
        delay = self.rates.take(client.principal.key, message_cost(nbytes), self.clock())
        if delay > 0.0:
            self.metrics.reads_paced.inc()
        return delay

    def principals(self) -> int:
        """Principals with a client open or a request held (the fair share divides among them)."""
        keys = set(self.open_by_principal)
        keys.update(r.principal for r in self.registry.running())
        return max(1, len(keys))

    # -- what a client may see ---------------------------------------------------------

    def attach(self, client: Client, request_id: str) -> RequestRecord:
        """``client``'s outbox watches the request from now on, after its replay; raises MessageError."""
        record = self.lookup(client, request_id)
        if client.outbox is None:
            raise protocol.MessageError(
                "bad_message", "this door cannot watch a request", request_id=request_id
            )
        if record.is_watched_by(client.id):
            raise protocol.MessageError(
                "already_attached",
                f"this connection already watches request {request_id!r}",
                field="id",
                request_id=request_id,
            )
        record.watch(client.id, client.outbox, attached=True, position=self.position_of(record))
        return record

    def lookup(self, client: Client, request_id: str) -> RequestRecord:
        """The record ``client`` may see (records.py's rule); raises MessageError ``not_found``."""
        principal = client.principal
        return self.registry.lookup(
            request_id,
            client.id,
            principal=principal.key if principal.authenticated else None,
            session=client.session,
        )


def who(principal: Principal) -> str:
    """``principal`` as a refusal names it: a token, an address, or this connection."""
    if principal.kind == "token":
        return f"token {principal.name!r}"
    if principal.kind == "address":
        return f"address {principal.name}"
    return "this connection"
