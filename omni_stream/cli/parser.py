"""The ``omni-stream`` argument parser: every command's options, checked as they are parsed."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, NoReturn

from .. import __version__
from ..config import LOOPS, TOKEN_ENV
from ..engine.scheduler import POLICIES
from ..params import positive_int
from .console import PROG
from .generate import cmd_generate
from .models import cmd_models
from .serve import EXIT_ENGINE_DEAD, cmd_serve

__all__ = ["build_parser"]

_MODEL_HELP = (
    "mixture (the embedded default), synthetic, diffusers:ID|PATH (a diffusers pipeline: "
    "a hub id or a saved folder; the diffusers extra), PATH.safetensors[?config=DIR] (a "
    "single-file checkpoint: SD 1.x/2.x, SDXL, SD3, Flux), or module:attr"
)
_MODEL_CONFIG_HELP = (
    "the diffusers folder single-file checkpoints take their config from (no network): "
    "TYPE=DIR for those of one architecture (diffusers' model type: v1, v2, xl_base, sd3, "
    "sd35_medium, sd35_large, flux-dev, flux-schnell), DIR for any; repeatable (docs/models.md)"
)
_PREVIEW_VAE_HELP = (
    "decode previews with a tiny autoencoder (taesd, taesdxl, taesd3, taef1: a folder or "
    "model id) on the model's device; diffusers models only (default: $OMNI_STREAM_PREVIEW_VAE, else none)"
)


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (no usage dump) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Shows each option's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is argparse.SUPPRESS or default is False or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)"


#: The knob ``--cache METHOD:NUMBER`` sets, per method.
_CACHE_KNOB = {"fbcache": "threshold", "teacache": "rel_l1"}


def _cache_spec(text: str) -> dict[str, object]:
    """``--cache``'s ``METHOD[:NUMBER]`` or ``METHOD:KNOB=V[,KNOB=V...]`` as the ``cache`` param's
    value (NUMBER: fbcache's threshold, teacache's rel_l1); the model checks the knobs."""
    method, _, rest = text.partition(":")
    out: dict[str, object] = {"method": method}
    if not rest:
        return out
    if "=" not in rest:
        knob = _CACHE_KNOB.get(method)
        if knob is None:
            raise argparse.ArgumentTypeError(
                f"{method!r} takes no bare number; name its knobs, as taylorseer:interval=5,warmup=3,order=1"
            )
        rest = f"{knob}={rest}"
    for pair in rest.split(","):
        name, eq, value = pair.partition("=")
        if not eq or not name.strip():
            raise argparse.ArgumentTypeError(f"{pair!r} is not KNOB=VALUE")
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name.strip()}: {value!r} is not a number") from None
        out[name.strip()] = (
            int(number) if number.is_integer() and name.strip() in ("interval", "warmup", "order") else number
        )
    return out


def _positive_int(text: str) -> int:
    try:
        return positive_int(int(text), "value")
    except ValueError:  # not an integer, or ParamsError: not positive
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None


def _non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _seed(text: str) -> int:
    wrong = argparse.ArgumentTypeError(f"expected an integer >= 0, or -1 for a random one, got {text!r}")
    try:
        value = int(text)
    except ValueError:
        raise wrong from None
    if value < -1:
        raise wrong
    return value


def _lora(text: str) -> tuple[str | None, str, str]:
    """``[MODEL:]NAME=PATH`` as (MODEL or None, NAME, PATH)."""
    from ..ids import MODEL_NAME

    left, sep, path = text.partition("=")
    model, colon, name = left.partition(":")
    if not colon:
        model, name = "", left
    model, name = model.strip(), name.strip()
    if not sep or not name or not path or (colon and not MODEL_NAME.fullmatch(model)):
        raise argparse.ArgumentTypeError(
            f"expected NAME=PATH, or MODEL:NAME=PATH for one model's (a LoRA file or folder), got {text!r}"
        )
    from ..models.diffusers.loras import lora_name_problem

    problem = lora_name_problem(name)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return model or None, name, path


def _lora_dir(text: str) -> tuple[str | None, str]:
    """``[MODEL=]DIR`` as (MODEL or None, DIR); a folder whose own name holds ``=`` is DIR."""
    from pathlib import Path

    from ..ids import MODEL_NAME

    model, sep, folder = text.partition("=")
    if sep and folder and MODEL_NAME.fullmatch(model) and not Path(text).is_dir():
        return model, folder
    return None, text


def _model_config(text: str) -> tuple[str, str]:
    """``[TYPE=]DIR`` as (TYPE or "", DIR); TYPE one of the single-file architectures."""
    from pathlib import Path

    from ..models.diffusers.single_file import ARCHITECTURES

    model_type, sep, folder = text.partition("=")
    if not sep or Path(text).is_dir():
        return "", text
    if model_type not in ARCHITECTURES or not folder:
        raise argparse.ArgumentTypeError(
            f"expected DIR or TYPE=DIR, TYPE one of {', '.join(ARCHITECTURES)}; got {text!r}"
        )
    return model_type, folder


def _add_lora_args(parser: argparse.ArgumentParser, *, bound: bool) -> None:
    """``--lora`` and ``--lora-dir``; ``bound``: the MODEL spellings of serve's several models."""
    parser.add_argument(
        "--lora",
        type=_lora,
        action="append",
        metavar="[MODEL:]NAME=PATH" if bound else "NAME=PATH",
        help="load a LoRA (a .safetensors file or a folder) that requests name in params.loras "
        "or the prompt (<lora:NAME:WEIGHT>); repeatable; diffusers models"
        + ("; MODEL: only that model's (else every model that takes LoRAs)" if bound else ""),
    )
    parser.add_argument(
        "--lora-dir",
        type=_lora_dir,
        action="append",
        metavar="[MODEL=]DIR" if bound else "DIR",
        help="load every LoRA in DIR (.safetensors files, each named by its stem)"
        + ("; MODEL=: only that model's" if bound else ""),
    )


def _add_model_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-config", type=_model_config, action="append", metavar="[TYPE=]DIR", help=_MODEL_CONFIG_HELP
    )


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {value}")
    return value


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw  # a bare word is a string: -p sampler=euler
    return key.strip(), value


def build_parser() -> argparse.ArgumentParser:
    """The ``omni-stream`` argument parser."""
    parser = _Parser(prog=PROG, description="Stream every step of generation.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log more, with tracebacks (give it before COMMAND)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    # Every subcommand's --help shows the defaults.
    helpful: dict[str, Any] = {"formatter_class": _DefaultsFormatter}

    gen = sub.add_parser("generate", help="run one request and write its result", **helpful)
    gen.add_argument(
        "prompt", nargs="?", metavar="PROMPT", help="the prompt (for models with a 'prompt' param)"
    )
    gen.add_argument("--steps", type=_positive_int, help="denoising steps")
    gen.add_argument("--size", type=_positive_int, metavar="PX", help="image side in pixels")
    gen.add_argument("--seed", type=_seed, help="random seed; -1 or none: a random one, said at the end")
    gen.add_argument("--sampler", metavar="NAME", help="sampler name")
    gen.add_argument(
        "--num-images",
        type=_positive_int,
        metavar="N",
        help="images from the prompt (diffusers models): written as OUT-0.png, OUT-1.png, ...",
    )
    gen.add_argument(
        "-p",
        "--param",
        type=_key_value,
        action="append",
        metavar="KEY=JSON",
        help="any other model param, e.g. -p 'shape=[3,64,64]' (repeatable)",
    )
    gen.add_argument("--model", default="mixture", metavar="SPEC", help=_MODEL_HELP)
    gen.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or sim")
    gen.add_argument(
        "--decoder",
        default="auto",
        help="preview decoder: auto (the model's, else by the frame's shape), rgb, sd15, sdxl, sd3, flux",
    )
    _add_model_config_arg(gen)
    gen.add_argument("--preview-vae", metavar="PATH|ID", default=None, help=_PREVIEW_VAE_HELP)
    _add_lora_args(gen, bound=False)
    gen.add_argument(
        "--previews",
        metavar="OUT.gif|.webp|.mp4|DIR",
        help="write previews: an animated GIF or WebP, an MP4 (the video extra), "
        "or a folder of numbered PNGs (a path without a suffix)",
    )
    gen.add_argument(
        "--every", type=_positive_int, metavar="N", help="preview every Nth step (and the last); default 1"
    )
    gen.add_argument(
        "--preview-size",
        type=_non_negative_int,
        default=512,
        metavar="PX",
        help="shrink previews to fit PX on the longer side; 0 keeps full size",
    )
    gen.add_argument(
        "-o",
        "--output",
        default="out.png",
        metavar="OUT",
        help="the result: .png (with the params in its metadata), .jpg, .webp; "
        "a video model's: .mp4, .webp, .gif; -p output=latent saves the "
        "final latent's preview instead",
    )
    gen.set_defaults(handler=cmd_generate)

    srv = sub.add_parser(
        "serve", help="serve the page, the HTTP API, event streams and the websocket on one port", **helpful
    )
    srv.add_argument(
        "--model",
        action="append",
        metavar="[NAME=]SPEC",
        help=_MODEL_HELP + "; repeat as NAME=SPEC to serve several, a request's "
        "'model' naming one (default: the first; default SPEC: mixture)",
    )
    srv.add_argument(
        "--model-dir",
        action="append",
        metavar="DIR",
        help="serve every .safetensors checkpoint in DIR (an AUTOMATIC1111 or ComfyUI "
        "checkpoint folder), each a model named by its stem; repeatable",
    )
    _add_model_config_arg(srv)
    srv.add_argument(
        "--scheduling",
        choices=POLICIES,
        default=None,
        help="which requests step first: preemptive (the default: the shortest remaining work, "
        "aged), round-robin, fcfs (docs/design.md, 'Scheduling and batching')",
    )
    srv.add_argument(
        "--quantum",
        type=_positive_int,
        metavar="N",
        default=None,
        help="preemptive: the rounds a running request keeps its place (default 1)",
    )
    srv.add_argument(
        "--max-loaded",
        type=_positive_int,
        metavar="N",
        default=None,
        help="with several --model: at most N on the device at once, the others loaded "
        "when a request needs them (least recently used unloaded); default: all, at start; "
        "with --ray, per replica",
    )
    srv.add_argument(
        "--min-residency",
        type=_non_negative_seconds,
        metavar="S",
        default=None,
        help="with --max-loaded: seconds a model keeps the device once loaded, and after its "
        "last request, before another may take it (default: $OMNI_STREAM_MIN_RESIDENCY, "
        "else 2.0)",
    )
    srv.add_argument(
        "--max-swaps-per-min",
        type=_positive_int,
        metavar="N",
        default=None,
        help="with --max-loaded: the most model switches in any minute "
        "(default: $OMNI_STREAM_MAX_SWAPS_PER_MIN, else 6)",
    )
    srv.add_argument("--preview-vae", metavar="PATH|ID", default=None, help=_PREVIEW_VAE_HELP)
    _add_lora_args(srv, bound=True)
    srv.add_argument(
        "--max-images",
        type=_positive_int,
        metavar="N",
        default=None,
        help="the most images one request may ask for with num_images (diffusers and "
        "mixture models; default 4)",
    )
    srv.add_argument(
        "--cache",
        type=_cache_spec,
        metavar="METHOD[:KNOBS]",
        default=None,
        help="the default step caching of requests that name none: none, fbcache[:T] (First-Block "
        "Cache at threshold T, default 0.05), teacache[:R] (TeaCache at rel_l1 R, default 0.4; Flux) "
        "or taylorseer[:interval=5,warmup=3,order=1], on the models that can use it (diffusers Flux "
        "and SD3 native loops); a request's own cache param wins",
    )
    srv.add_argument(
        "--no-batch",
        action="store_true",
        help="run each request alone: no batching across requests (a diffusers model's "
        "results then equal pipe()'s bit for bit whatever else runs)",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=_port, default=8765, help="port to listen on; 0 picks a free one")
    srv.add_argument(
        "--token",
        action="append",
        metavar="[NAME=]SECRET",
        help=f"bearer token clients must send on every route but /health and the page "
        f"(default: ${TOKEN_ENV}); repeat with NAME=SECRET for several tenants, each its own "
        "principal (docs/protocol.md, Security)",
    )
    srv.add_argument(
        "--tokens-file",
        metavar="PATH",
        default=None,
        help="a file of NAME=SECRET [priority=N] lines, one tenant each (default: $OMNI_STREAM_TOKENS_FILE)",
    )
    srv.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a host name the server answers to besides its address (repeatable; "
        "default: $OMNI_STREAM_ALLOWED_HOSTS)",
    )
    srv.add_argument(
        "--trusted-proxy",
        action="append",
        metavar="ADDR",
        help="a proxy (address or network) whose X-Forwarded-For names the client "
        "(repeatable; default: $OMNI_STREAM_TRUSTED_PROXIES)",
    )
    srv.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without the token (for a scraper that cannot send one)",
    )
    srv.add_argument(
        "--allow-origin",
        action="append",
        metavar="ORIGIN",
        help="a browser Origin allowed to connect (repeatable)",
    )
    srv.add_argument(
        "--webhook-allow",
        action="append",
        metavar="PATTERN",
        help="a URL a request's webhook may call, '*' at the end matching the rest "
        "('https://hooks.example.com/*'; repeatable; default: $OMNI_STREAM_WEBHOOK_ALLOW; "
        "none: webhooks are refused; docs/webhooks.md)",
    )
    srv.add_argument(
        "--webhook-secret",
        metavar="whsec_...",
        default=None,
        help="the secret webhooks are signed with, Standard Webhooks' whsec_ base64 form "
        "(default: $OMNI_STREAM_WEBHOOK_SECRET, else one made up and logged at start)",
    )
    srv.add_argument(
        "--state-dir",
        metavar="DIR",
        default=None,
        help="write every accepted request, its checkpoints and its results to DIR, and "
        "after a crash or restart resume the unfinished ones and serve the finished ones "
        "(default: $OMNI_STREAM_STATE_DIR; none: nothing survives the process; with --ray, "
        "the server in front writes the checkpoints its replicas send; "
        "docs/reliability.md, The state directory)",
    )
    srv.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        metavar="N",
        default=None,
        help="with --state-dir: checkpoint a request every N steps, for models that can "
        "(default: $OMNI_STREAM_CHECKPOINT_EVERY, else 10); with --ray, also the steps between "
        "two checkpoints a replica sends the server, from which a lost replica's requests "
        "go on on another (default 10)",
    )
    srv.add_argument(
        "--checkpoint-seconds",
        type=float,
        metavar="T",
        default=None,
        help="with --state-dir: write at most one checkpoint every T seconds per request "
        "(default: $OMNI_STREAM_CHECKPOINT_SECONDS, else no such floor)",
    )
    srv.add_argument(
        "--state-max-bytes",
        type=_positive_int,
        metavar="BYTES",
        default=None,
        help="with --state-dir: what DIR may hold; the oldest finished requests are "
        "deleted to make room (default: $OMNI_STREAM_STATE_MAX_BYTES, else 2 GiB)",
    )
    srv.add_argument(
        "--device",
        default="auto",
        help="auto, cpu, cuda, cuda:N or sim; several (cuda:0,cuda:1) or 'all' "
        "serve one engine group, a model per device",
    )
    srv.add_argument(
        "--ray",
        action="store_true",
        help="run the model as Ray Serve replicas, one engine each, and serve in front "
        "of them (the ray extra; docs/scale-out.md)",
    )
    srv.add_argument(
        "--ray-address",
        metavar="ADDR",
        default=None,
        help="with --ray: the Ray cluster (auto, HOST:6379); default $RAY_ADDRESS, else a local Ray",
    )
    srv.add_argument("--replicas", type=_positive_int, default=1, metavar="N", help="with --ray: replicas")
    srv.add_argument(
        "--num-gpus",
        type=float,
        default=0.0,
        metavar="G",
        help="with --ray: GPUs per replica; a fraction packs several on one GPU",
    )
    srv.add_argument(
        "--max-handovers",
        type=_non_negative_int,
        metavar="N",
        default=None,
        help="with --ray: the most times one request is handed over to another replica when "
        "its replica dies (default 2; 0: never, its requests fail, and no checkpoints are sent)",
    )
    srv.add_argument(
        "--checkpoint-max-bytes",
        type=_non_negative_int,
        metavar="BYTES",
        default=None,
        help="with --ray: the bytes of checkpoints the server keeps for hand-overs, all "
        "requests together; past it the oldest are dropped, and theirs start again from "
        "step 0 (default 268435456, 256 MiB; 0: none kept, none sent)",
    )
    srv.add_argument(
        "--loop",
        choices=LOOPS,
        default=None,
        help="the event loop: uvloop (the default where installed), asyncio (both serve "
        "on uvicorn), or trio (served by hypercorn: pip install 'omni-stream[trio]'; "
        "not with --ray)",
    )
    srv.add_argument(
        "--stay-dead",
        action="store_true",
        help="keep running (/health 503) when the engine dies, for debugging; "
        f"by default the server shuts down and exits with status {EXIT_ENGINE_DEAD}",
    )
    srv.set_defaults(handler=cmd_serve)

    mod = sub.add_parser("models", help="list the models and their params", **helpful)
    mod.add_argument(
        "names",
        nargs="*",
        metavar="SPEC",
        help="only these: built-in names, diffusers:ID|PATH, PATH.safetensors or module:attr",
    )
    _add_model_config_arg(mod)
    mod.add_argument("--json", action="store_true", help="print JSON")
    mod.set_defaults(handler=cmd_models)

    # Listed for --help only: main() hands everything after "bench" to
    # `python -m benchmarks` untouched (argparse would eat its options).
    sub.add_parser("bench", help="run the benchmark suite (python -m benchmarks ARGS...)", add_help=False)
    return parser
