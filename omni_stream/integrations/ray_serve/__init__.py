"""Engines on a Ray cluster: one Engine per Serve replica, behind one EngineLike.

>>> from omni_stream.integrations.ray_serve import deploy
>>> engine = deploy("diffusers:stabilityai/sd-turbo", replicas=4, num_gpus=1)   # doctest: +SKIP
>>> async with engine:                                                          # doctest: +SKIP
...     async for frame in engine.stream({"prompt": "a red cat", "steps": 4}):
...         print(frame.step, frame.total)

Several models, each replica holding at most one on its device, requests
routed to a replica that holds theirs (Ray Serve's model multiplexing):

>>> engine = deploy({"turbo": "diffusers:stabilityai/sd-turbo", "mix": "mixture"},  # doctest: +SKIP
...                 max_models_per_replica=1, replicas=4, num_gpus=1)
>>> engine.stream({"prompt": "a red cat"}, model="turbo")                      # doctest: +SKIP

The modules, one job each::

    deploy.py     deploy / undeploy / build_app / app_builder: the Serve application
    replica.py    EngineReplica: the deployment's class (owner task, per-request pump, health)
    remote.py     RemoteEngine: the front door's EngineLike over a DeploymentHandle
    stream.py     RemoteStream: one request's frames, acknowledged, cancelled, handed over, errors translated
    handover.py   a lost replica's requests go on on another: checkpoints kept, the decision (pure)
    board.py      ReplicaBoard: the deployment actor relaying acknowledgements and reports
    wire.py       what crosses Ray: Description; per request Submit, Header, WireFrame, WireBatch,
                  WireCheckpoint, WireError
    report.py     replica reports, and health / statistics made of them (pure)
    card.py       ModelCard: the model's metadata, the front door's stand-in for it (pure)
    translate.py  Ray's errors to this project's, at one boundary

docs/scale-out.md says what each guarantees (cancel, backpressure, a lost
replica) and what was measured. Needs the ``ray`` extra:
``pip install "omni-stream[ray]"``.
"""

from __future__ import annotations

try:
    import ray.serve  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        f"omni_stream.integrations.ray_serve needs Ray Serve ({exc}); "
        'install it with: pip install "omni-stream[ray]"'
    ) from exc

from .card import ModelCard
from .deploy import DEPLOYMENT, app_builder, build_app, deploy, undeploy
from .handover import CheckpointKeeper, Handover, HandoverSettings
from .remote import DEFAULT_WINDOW, RemoteEngine, connect_ray
from .replica import BOARD, EngineReplica, ModelSource, ModelSources, ReplicaSettings
from .report import ReplicaReport, ReplicaView
from .stream import RemoteStream

__all__ = [
    "BOARD",
    "DEFAULT_WINDOW",
    "DEPLOYMENT",
    "CheckpointKeeper",
    "EngineReplica",
    "Handover",
    "HandoverSettings",
    "ModelCard",
    "ModelSource",
    "ModelSources",
    "RemoteEngine",
    "RemoteStream",
    "ReplicaReport",
    "ReplicaSettings",
    "ReplicaView",
    "app_builder",
    "build_app",
    "connect_ray",
    "deploy",
    "undeploy",
]
