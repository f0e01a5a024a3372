"""``omni-stream serve``: the models (here, or on Ray replicas), the server, its exit status."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
from collections.abc import Callable
from typing import Any

from ..config import run, token as env_token
from ..engine.like import looks_like_engine
from .console import PROG, UsageError, describe_error, print_error
from .loader import ModelLoader, check_model_configs, named_spec
from .loras import lora_options
from .model_dir import model_dir_specs

__all__ = ["EXIT_ENGINE_DEAD", "EXIT_SERVER_FAILED", "cmd_serve"]

#: ``serve``'s exit statuses when it shut itself down (README, docs/protocol.md).
EXIT_ENGINE_DEAD = 3
EXIT_SERVER_FAILED = 4


def _served_specs(given: list[str], folders: list[str]) -> list[tuple[str, str]]:
    """Each ``--model`` as (name, spec), then each checkpoint of each ``--model-dir``; one plain
    SPEC alone is named after the model it makes; none at all: mixture."""
    named = [named_spec(text) for text in given]
    if not folders and len(named) == 1 and named[0][0] is None:
        return [("", named[0][1])]
    out: dict[str, str] = {}
    for (name, spec), text in zip(named, given, strict=True):
        if name is None:
            raise UsageError(f"--model {text!r}: with several models, give each a name: NAME=SPEC")
        if not spec:
            raise UsageError(f"--model {text!r}: no SPEC after {name}=")
        if name in out:
            raise UsageError(f"--model: the name {name!r} is given twice")
        out[name] = spec
    for folder in folders:
        for name, path in model_dir_specs(folder):
            if name in out:
                raise UsageError(
                    f"--model-dir {folder}: {path} would be model {name!r}, which is named already"
                )
            out[name] = path
    return list(out.items()) or [("", "mixture")]


def _door_options(args: argparse.Namespace) -> dict[str, Any]:
    """The server's door options the command line gave (the rest come from the environment)."""
    out: dict[str, Any] = {}
    if args.tokens_file is not None:
        out["tokens_file"] = args.tokens_file
    if args.allowed_host:
        out["allowed_hosts"] = list(args.allowed_host)
    if args.trusted_proxy:
        out["trusted_proxies"] = list(args.trusted_proxy)
    if args.webhook_secret is not None:
        out["webhook_secret"] = args.webhook_secret
    if args.webhook_allow:
        out["webhook_allow"] = list(args.webhook_allow)
    # The state directory's (server/state.py); unset: the environment's, else the defaults.
    for name in ("state_dir", "checkpoint_every", "checkpoint_seconds", "state_max_bytes"):
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    return out


def _handover_options(args: argparse.Namespace) -> dict[str, Any]:
    """deploy()'s hand-over options the command line gave (the rest: deploy's defaults); a
    UsageError for one given without --ray, where nothing would read it."""
    for name in ("max_handovers", "checkpoint_max_bytes"):
        if getattr(args, name) is not None and not args.ray:
            option = "--" + name.replace("_", "-")
            raise UsageError(f"{option} is for --ray: a lost replica's requests handed over to another")
    names = ("checkpoint_every", "max_handovers", "checkpoint_max_bytes")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def cmd_serve(args: argparse.Namespace) -> int:
    # A server's operator wants its lifecycle lines (the model loaded and its
    # mode, the URL it listens on, shutdown), not only warnings: from before
    # the model loads.
    args.log.show_info("omni_stream")
    # Several --token (named: NAME=SECRET) serve several tenants; none: $OMNI_STREAM_TOKEN.
    token: Any = (args.token[0] if len(args.token) == 1 else list(args.token)) if args.token else env_token()
    from ..engine.group import names_group

    loras = lora_options(args)  # a bad folder or a name twice: said before anything loads
    configs = check_model_configs(args.model_config or ())
    specs = _served_specs(args.model or [], args.model_dir or [])
    loras.check_models(name for name, _ in specs)
    if args.max_loaded is not None and not specs[0][0]:
        raise UsageError("--max-loaded bounds the models loaded at once: give them as --model NAME=SPEC")
    residency = [
        f
        for f, v in (("--min-residency", args.min_residency), ("--max-swaps-per-min", args.max_swaps_per_min))
        if v is not None
    ]
    if residency and args.max_loaded is None:
        raise UsageError(f"{' and '.join(residency)} pace model switches: give --max-loaded too")
    if residency and args.ray:
        raise UsageError(
            f"{' and '.join(residency)} apply to this server's models; Ray replicas read "
            "OMNI_STREAM_MIN_RESIDENCY and OMNI_STREAM_MAX_SWAPS_PER_MIN from their environment"
        )
    if args.loop == "trio" and args.ray:
        # Ray's client runs on asyncio only; the engines in this process run on any loop.
        raise UsageError("--loop trio serves engines in this process; --ray needs asyncio (or uvloop)")
    handover = _handover_options(args)

    # Values, not closures: with --ray they are pickled to every replica, which builds its models.
    loaders = {
        name: ModelLoader.of(
            spec,
            args.preview_vae,
            loras.for_model(name),
            no_batch=args.no_batch,
            max_images=args.max_images,
            # LoRAs for every model pass over one that takes none, unless it is the only one.
            loras_required=len(specs) == 1 or name in loras.bound,
            model_configs=configs,
            # Likewise --cache: it passes over a model that cannot cache, unless it is the only one.
            cache=args.cache,
            cache_required=len(specs) == 1,
        )
        for name, spec in specs
    }
    load = next(iter(loaders.values()))

    # The engine's scheduling (engine/scheduler.py): for the engines made here or in replicas.
    engine_options = {k: getattr(args, k) for k in ("scheduling", "quantum") if getattr(args, k) is not None}
    model: Any
    if specs[0][0] and args.ray:  # named, over Ray: each replica serves them, routed by model
        if names_group(args.device):
            raise UsageError(
                "--ray runs one engine per model on each replica: give one --device (auto: the replica's GPU)"
            )
        try:
            from ..integrations.ray_serve import deploy
        except ImportError as exc:
            print_error(f"--ray needs Ray Serve: pip install 'omni-stream[ray]' ({exc})")
            return 2
        # Each replica builds every model with its factory; --max-loaded bounds
        # those on its device (loaded on demand, Serve routing by model).
        model = deploy(
            loaders,
            max_models_per_replica=args.max_loaded,
            replicas=args.replicas,
            num_gpus=args.num_gpus,
            address=args.ray_address,
            engine_kwargs={"device": args.device, **engine_options},
            **handover,
        )
    elif specs[0][0]:  # named: a request's `model` picks one
        if names_group(args.device):
            raise UsageError(
                "several --model run one engine each on one device, in this process: "
                "not with a --device list (yet)"
            )
        from ..engine.router import ModelRouter

        # Every model is built now (host memory; its params known); --max-loaded
        # bounds those on the device at once, loading the others on demand.
        model = ModelRouter(
            {name: loader() for name, loader in loaders.items()},
            max_loaded=args.max_loaded,
            min_residency_s=args.min_residency,
            max_swaps_per_min=args.max_swaps_per_min,
            device=args.device,
            **engine_options,
        )
    elif args.ray:
        if names_group(args.device):
            raise UsageError("--ray runs one engine per replica: give one --device (auto: the replica's GPU)")
        try:
            from ..integrations.ray_serve import deploy
        except ImportError as exc:
            print_error(f"--ray needs Ray Serve: pip install 'omni-stream[ray]' ({exc})")
            return 2
        # The replicas build the model; this process only serves in front of them.
        model = deploy(
            load,
            replicas=args.replicas,
            num_gpus=args.num_gpus,
            address=args.ray_address,
            engine_kwargs={"device": args.device, **engine_options},
            **handover,
        )
    else:
        # A group builds one model per device with the factory (before it listens).
        model = load if names_group(args.device) else load()
    from ..errors import EngineDeadError

    serve: Callable[..., object]  # blocking, or a coroutine to run (the CLI's tests' stand-in)
    try:
        from ..server import serve
    except ImportError as exc:
        print_error(f"the server is unavailable: {exc}")
        return 1
    server_failed: tuple[type[BaseException], ...] = ()
    try:
        from ..server.app import ServerFailedError
    except ImportError:
        pass  # a stand-in for the server package (the CLI's tests) has no app module
    else:
        server_failed = (ServerFailedError,)
    try:
        result = serve(
            model=model,
            host=args.host,
            port=args.port,
            token=token,
            allow_origins=list(args.allow_origin or ()),
            device=args.device,
            **_door_options(args),
            stay_dead=args.stay_dead,
            metrics_public=args.metrics_public,
            **({"loop": args.loop} if args.loop is not None else {}),
            # For the engine the server makes from a model (the router and Ray took theirs above).
            **({} if looks_like_engine(model) else engine_options),
        )
        # serve() may block and run its own loop, or be a coroutine for us to run.
        if inspect.iscoroutine(result):
            run(lambda: result)
    except EngineDeadError:
        # The server logged why (one ERROR line) before it shut down; a
        # distinct status tells a supervisor to replace the process.
        print(f"{PROG}: exiting: the engine died (status {EXIT_ENGINE_DEAD})", file=sys.stderr)
        return EXIT_ENGINE_DEAD
    except server_failed:
        print(f"{PROG}: exiting: the server failed (status {EXIT_SERVER_FAILED})", file=sys.stderr)
        return EXIT_SERVER_FAILED
    except KeyboardInterrupt:
        # Ctrl-C is how a server is stopped: not a failure.
        print(f"{PROG}: stopped", file=sys.stderr)
    except asyncio.CancelledError as exc:
        # Nothing outside serve() can cancel it: a cancellation escaping is
        # its own shutdown going wrong. Say so in one line, exit 1.
        print_error(f"the server stopped with a stray cancellation: {describe_error(exc)}")
        return 1
    return 0
