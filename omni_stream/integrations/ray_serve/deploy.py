"""deploy / undeploy: run EngineReplicas as a Serve application, and ``app_builder`` for config files.

``deploy`` is ``serve.run`` of :func:`build_app`, then a connected
:class:`RemoteEngine`. ``app_builder`` is the same application for
``serve deploy`` / ``serve run`` config files and KubeRay's ``RayService``
(``import_path: omni_stream.integrations.ray_serve:app_builder``, the
keyword arguments of ``build_app`` under ``args``).

Several models: ``model={"sd": "diffusers:ID", "mix": "mixture"}`` serves
each by name (a request's ``model``; the first is the default). Every
replica builds every model (host memory); on the device it holds all of
them from its start, or, with ``max_models_per_replica=N`` (fewer than the
models), at most N, loading one on the first request for it and unloading
the least recently used; Serve then routes each request to a replica that
holds its model (model multiplexing; replica.py, remote.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, cast

import ray
from ray import cloudpickle, serve
from ray.serve import Application
from ray.serve.config import DeploymentActorConfig
from ray.serve.deployment import Deployment

from ...engine.router import check_model_name
from ...errors import ParamsError
from ...model import StepModel
from ...params import positive_int
from .board import ReplicaBoard
from .handover import (
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_CHECKPOINT_MAX_BYTES,
    DEFAULT_MAX_HANDOVERS,
    HandoverSettings,
)
from .remote import DEFAULT_WINDOW, RemoteEngine, connect_ray
from .replica import BOARD, EngineReplica, ModelSources, ReplicaSettings
from .translate import startup_failed

__all__ = ["DEPLOYMENT", "app_builder", "build_app", "deploy", "undeploy"]

logger = logging.getLogger("omni_stream.ray_serve")

#: The deployment's name inside its application.
DEPLOYMENT = "EngineReplica"
#: Engine's own default max_batch_size (engine.py).
_ENGINE_BATCH = 8


def build_app(
    model: ModelSources,
    *,
    max_models_per_replica: int | None = None,
    replicas: int = 1,
    num_gpus: float = 0,
    num_cpus: float | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
    ray_actor_options: Mapping[str, Any] | None = None,
    settings: ReplicaSettings | None = None,
    **deployment_options: Any,
) -> Application:
    """The Serve application (``Deployment.bind(...)``) of ``replicas`` EngineReplicas.

    ``model``: a registry spec ("synthetic", "diffusers:ID", "module:attr"),
    a StepModel (pickled to every replica) or a callable building one; or
    several of those by name (``{name: source}``, the first the default).
    ``max_models_per_replica``: with several, the most each replica holds on
    its device, loading on demand and routed by model (None, or at least
    the number of models: every replica loads every model at start).
    ``num_gpus`` / ``num_cpus`` per replica (``ray_actor_options`` for the
    rest); ``engine_kwargs`` go to each replica's Engine (``device``
    defaults to "auto": the replica's GPU when it has one).
    ``max_ongoing_requests`` defaults to twice the engine's batch size, at
    least 16 (Serve's own default of 5 would cap a replica below one
    batch); a value below the batch size raises ParamsError.
    ``deployment_options`` go to ``serve.deployment(...).options``
    (``health_check_period_s``, ``graceful_shutdown_timeout_s``,
    ``autoscaling_config`` with ``replicas=None``, ...). Raises ParamsError
    also for no models or a bad name (field ``model``), and for a
    ``max_models_per_replica`` that is not a positive int or comes with one
    unnamed model.
    """
    sources, max_models = _served(model, max_models_per_replica)
    kwargs = dict(engine_kwargs or {})
    batch = kwargs.get("max_batch_size", _ENGINE_BATCH)
    if max_ongoing_requests is None:
        max_ongoing_requests = max(16, 2 * int(batch))
    if (
        isinstance(max_ongoing_requests, bool)
        or not isinstance(max_ongoing_requests, int)
        or (max_ongoing_requests < batch)
    ):
        raise ParamsError(
            f"max_ongoing_requests must be an int of at least the engine's max_batch_size ({batch}), "
            f"got {max_ongoing_requests!r}: Serve would never hand a replica a full batch",
            field="max_ongoing_requests",
        )
    actor_options = dict(ray_actor_options or {})
    actor_options.setdefault("num_gpus", num_gpus)
    if num_cpus is not None:
        actor_options["num_cpus"] = num_cpus
    # cast: serve.deployment is annotated as the decorator factory only
    # (Callable[[Callable], Deployment]); given the class, it returns the Deployment.
    deployment = cast(Deployment, serve.deployment(EngineReplica)).options(
        name=DEPLOYMENT,
        num_replicas=replicas,
        ray_actor_options=actor_options,
        max_ongoing_requests=max_ongoing_requests,
        deployment_actors=[
            DeploymentActorConfig(
                name=BOARD, actor_class=ray.remote(ReplicaBoard), actor_options={"num_cpus": 0}
            )
        ],
        **deployment_options,
    )
    try:
        return deployment.bind(sources, kwargs, settings or ReplicaSettings(), max_models)
    except TypeError as exc:  # Serve pickles the init args here, to send them to every replica
        raise _unpicklable(sources, kwargs, exc) from exc


def _unpicklable(sources: ModelSources, engine_kwargs: Mapping[str, Any], exc: TypeError) -> ParamsError:
    """ParamsError naming the argument of ``bind`` that Serve could not pickle (``exc``)."""
    why = str(exc.__cause__ or exc).strip().splitlines()[0]
    try:
        cloudpickle.dumps(sources)  # type: ignore[no-untyped-call]  # ray's vendored copy is untyped
    except Exception:  # noqa: BLE001 - any failure to pickle it is the finding
        return ParamsError(
            f"the model cannot be sent to the replicas: Ray could not pickle it ({why}); give a "
            "registry spec, a StepModel or a picklable factory (a module-level function or class "
            "instance, not a closure over unpicklable state)",
            field="model",
        )
    return ParamsError(
        f"engine_kwargs cannot be sent to the replicas: Ray could not pickle them ({why})",
        field="engine_kwargs",
    )


def _served(model: ModelSources, max_models: int | None) -> tuple[ModelSources, int | None]:
    """``model`` checked (a mapping as a plain dict, to pickle) and the replicas' bound on loaded
    models: None where they hold every model (routing by model would then only crowd one)."""
    if not isinstance(model, Mapping):
        if max_models is not None:
            raise ParamsError(
                "max_models_per_replica bounds several models: give model as {name: source, ...}",
                field="max_models_per_replica",
            )
        return model, None
    if not model:
        raise ParamsError("give at least one model: {name: source, ...}", field="model")
    for name, source in model.items():
        check_model_name(name)
        if not (isinstance(source, (str, StepModel)) or callable(source)):
            raise ParamsError(
                f"model {name!r}: a registry spec, a StepModel or a factory, not {type(source).__name__}",
                field="model",
            )
    if max_models is not None:
        positive_int(max_models, "max_models_per_replica")
        if max_models >= len(model):
            max_models = None
    return dict(model), max_models


def app_builder(args: Mapping[str, Any]) -> Application:
    """The application for a Serve config file: ``args`` are :func:`build_app`'s keyword arguments.

    ``model`` is required (a registry spec, or several by name: a mapping
    of specs); ``max_models_per_replica``, ``replicas``, ``num_gpus``,
    ``num_cpus``, ``engine_kwargs``, ``max_ongoing_requests`` are optional.
    """
    options = dict(args)
    if "model" not in options:
        raise ParamsError("the omni_stream application needs args.model (e.g. 'diffusers:ID')", field="model")
    model = options.pop("model")
    return build_app(model, **options)


def deploy(
    model: ModelSources,
    *,
    max_models_per_replica: int | None = None,
    replicas: int = 1,
    num_gpus: float = 0,
    num_cpus: float | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    name: str = "omni_stream",
    max_ongoing_requests: int | None = None,
    address: str | None = None,
    window: int = DEFAULT_WINDOW,
    ray_actor_options: Mapping[str, Any] | None = None,
    settings: ReplicaSettings | None = None,
    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY,
    max_handovers: int = DEFAULT_MAX_HANDOVERS,
    checkpoint_max_bytes: int = DEFAULT_CHECKPOINT_MAX_BYTES,
    **deployment_options: Any,
) -> RemoteEngine:
    """Run the Serve application ``name`` (one Engine per replica) and return a connected RemoteEngine.

    Blocks until every replica has loaded its model (``serve.run``; with
    ``max_models_per_replica``, built its models: they load on demand); from
    async code run it in a worker thread (called on a running event loop
    it blocks the loop, and returns the RemoteEngine unconnected: entering
    it connects). Starts Serve without its HTTP
    proxy unless Serve runs already (the front door is omni_stream's own
    server). Replaces an application of the same name. Arguments as
    :func:`build_app`; ``address`` as :func:`connect_ray`; ``window``,
    ``checkpoint_every``, ``max_handovers`` and ``checkpoint_max_bytes`` as
    RemoteEngine's (a request whose replica dies goes on on another from its
    newest checkpoint: handover.py); ``settings`` the replicas'
    (ReplicaSettings). Raises ParamsError for bad options or a ``model``
    that cannot be pickled to the replicas, and EngineDeadError naming what
    a replica raised when the replicas fail to start (Serve gave up
    retrying; ``__cause__`` is ``serve.run``'s RuntimeError).
    """
    # Checked before anything is deployed.
    HandoverSettings(checkpoint_every, max_handovers, checkpoint_max_bytes)
    app = build_app(
        model,
        max_models_per_replica=max_models_per_replica,
        replicas=replicas,
        num_gpus=num_gpus,
        num_cpus=num_cpus,
        engine_kwargs=engine_kwargs,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options=ray_actor_options,
        settings=settings,
        **deployment_options,
    )
    connect_ray(address)
    serve.start(proxy_location="Disabled")
    try:
        serve.run(app, name=name, route_prefix=None)
    except RuntimeError as exc:  # DEPLOY_FAILED; the why is only in the deployment's status
        raise startup_failed(name, exc, _deployment_status(name)) from exc
    engine = RemoteEngine(
        name,
        address=address,
        window=window,
        checkpoint_every=checkpoint_every,
        max_handovers=max_handovers,
        checkpoint_max_bytes=checkpoint_max_bytes,
    )
    if not _in_running_loop():
        engine.connect()
    return engine


def _deployment_status(name: str) -> str | None:
    """The status message of application ``name``'s deployment, or None where Serve has none."""
    try:
        app = serve.status().applications.get(name)
    except Exception:  # noqa: BLE001 - the message only explains a failure already raised
        return None
    deployment = app.deployments.get(DEPLOYMENT) if app is not None else None
    return deployment.message if deployment is not None and deployment.message else None


def _in_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def undeploy(name: str = "omni_stream") -> None:
    """Delete the Serve application ``name`` (its replicas and board); a no-op when absent."""
    serve.delete(name)
