"""The command line: ``omni-stream generate | serve | models | bench``.

Exit status: 0 done; 1 the run failed (the model raised, the engine died,
a file could not be written); 2 bad arguments or params; 130 interrupted.
Every error is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import inspect
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TextIO

from . import __version__
from .config import LOOPS, TOKEN_ENV, run, token as env_token
from .engine.like import looks_like_engine
from .engine.scheduler import POLICIES
from .errors import OmniStreamError, ParamsError
from .model import StepModel, split_output
from .params import positive_int

# TOKEN_ENV (config.py's) is re-exported: cli.TOKEN_ENV is where it was first defined.
__all__ = ["main", "entry", "build_parser", "ProgressBar", "TOKEN_ENV"]

PROG = "omni-stream"
#: ``serve``'s exit statuses when it shut itself down (README, docs/protocol.md).
EXIT_ENGINE_DEAD = 3
EXIT_SERVER_FAILED = 4

# CLI flag -> the model param it sets; passed only when the model declares it.
_MODEL_HELP = (
    "mixture (the embedded default), synthetic, diffusers:ID|PATH (a diffusers pipeline: "
    "a hub id or a saved folder; the diffusers extra), or module:attr"
)
_DIFFUSERS_LINE = (
    "diffusers:ID|PATH: a diffusers pipeline (a hub id or a saved folder; the diffusers extra): "
    "native step-wise loops for SD 1.x/2.x, SDXL, SD3 and Flux, callback mode for every other "
    f"pipeline; `{PROG} models diffusers:ID` lists its params and mode"
)
_PREVIEW_VAE_HELP = (
    "decode previews with a tiny autoencoder (taesd, taesdxl, taesd3, taef1: a folder or "
    "model id) on the model's device; diffusers models only (default: $OMNI_STREAM_PREVIEW_VAE, else none)"
)

_PARAM_FLAGS = (
    ("prompt", "PROMPT"),
    ("steps", "--steps"),
    ("size", "--size"),
    ("seed", "--seed"),
    ("sampler", "--sampler"),
    ("num_images", "--num-images"),
)


class _UsageError(Exception):
    """Bad command-line usage found after parsing; exit status 2."""


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


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", str(text)).strip()


def _describe_error(exc: BaseException) -> str:
    text = _one_line(str(exc)) or type(exc).__name__
    cause = exc.__cause__
    # What the model (or the machinery) raised is what a user needs to see,
    # once: most messages here already quote it.
    if cause is not None and not isinstance(exc, ParamsError):
        detail = _one_line(str(cause))
        if detail not in text:
            text += f" ({type(cause).__name__}" + (f": {detail})" if detail else ")")
    return text


class _StderrLogHandler(logging.Handler):
    """Library log records as ``omni-stream: warning: ...`` lines on stderr.

    Looks ``sys.stderr`` up on every record (it may be swapped, as pytest
    does). Tracebacks only with ``--verbose``: a user sees one line per event.
    """

    def __init__(self, verbose: bool) -> None:
        super().__init__(logging.DEBUG if verbose else logging.WARNING)
        self.verbose = verbose

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"{PROG}: {record.levelname.lower()}: {_one_line(record.getMessage())}"
            if self.verbose and record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            print(text, file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


class _CliLogging:
    """The library's log records on stderr while one command runs; levels restored after.

    Warnings always; INFO only from the loggers a command asks for
    (``show_info``), everything with ``--verbose``.
    """

    def __init__(self, verbose: bool) -> None:
        self.handler = _StderrLogHandler(verbose)
        self._verbose = verbose
        self._saved: dict[str, int] = {}

    def __enter__(self) -> _CliLogging:
        logging.getLogger("omni_stream").addHandler(self.handler)
        if self._verbose:
            self.show_info("omni_stream")
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("omni_stream").removeHandler(self.handler)
        for name, level in self._saved.items():
            logging.getLogger(name).setLevel(level)

    def show_info(self, name: str) -> None:
        """Show INFO records of logger ``name`` (and below it) for the rest of the command."""
        logger = logging.getLogger(name)
        self._saved.setdefault(name, logger.level)
        logger.setLevel(logging.INFO)
        if self.handler.level > logging.INFO:
            self.handler.setLevel(logging.INFO)


def _error(message: str) -> None:
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)


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


def _lora(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a LoRA file or folder), got {text!r}")
    return name.strip(), path


def _add_lora_args(parser: argparse.ArgumentParser) -> None:
    """``--lora`` and ``--lora-dir``, the same on ``generate`` and ``serve``."""
    parser.add_argument("--lora", type=_lora, action="append", metavar="NAME=PATH",
                        help="load a LoRA (a .safetensors file or a folder) that requests name in "
                        "params.loras; repeatable; diffusers models")
    parser.add_argument("--lora-dir", action="append", metavar="DIR",
                        help="load every LoRA in DIR (.safetensors files, each named by its stem)")


def _loras(args: argparse.Namespace) -> dict[str, str]:
    """``{name: path}`` from --lora NAME=PATH and --lora-dir DIR; _UsageError for a clash or a bad folder."""
    from .models.diffusers.loras import lora_dir

    sources: list[tuple[str, dict[str, str]]] = []
    for folder in args.lora_dir or ():
        try:
            sources.append((f"--lora-dir {folder}", lora_dir(folder)))
        except ValueError as exc:
            raise _UsageError(f"--lora-dir: {exc}") from None
    sources += [(f"--lora {name}=...", {name: path}) for name, path in args.lora or ()]
    found: dict[str, str] = {}
    for source, loras in sources:
        for name, path in loras.items():
            if name in found:
                raise _UsageError(f"{source}: a LoRA named {name!r} is given twice")
            found[name] = path
    return found


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


# -- progress ------------------------------------------------------------------


def _clock(seconds: float) -> str:
    # Rounded up: an ETA of 0:00 while work remains reads as a hang.
    seconds = math.ceil(seconds)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class ProgressBar:
    """A one-line progress bar redrawn with ``\\r``: step/total, steps/s, ETA.

    The rate counts from the first frame, so model loading does not skew it.
    Redraws at most every ``interval`` seconds (and always on the last
    step): this runs once per step and must stay cheap. With ``live``
    False (stderr is not a terminal) only :meth:`finish` writes.
    """

    def __init__(
        self,
        out: TextIO,
        *,
        live: bool,
        width: int = 24,
        interval: float = 0.1,
        clock: Any = time.monotonic,
    ) -> None:
        self._out = out
        self._live = live
        self._width = width
        self._interval = interval
        self._clock = clock
        self._start = clock()
        self._first: tuple[int, float] | None = None
        self._drawn_at = -float("inf")
        self._step = 0
        self._total = 0

    def rate(self, step: int, now: float) -> float | None:
        """Steps per second since the first frame, or None before two frames."""
        if self._first is None or step <= self._first[0] or now <= self._first[1]:
            return None
        return (step - self._first[0]) / (now - self._first[1])

    def line(self, step: int, total: int, now: float) -> str:
        filled = self._width * step // max(total, 1)
        bar = "#" * filled + "." * (self._width - filled)
        rate = self.rate(step, now)
        speed = f"{rate:.1f} steps/s" if rate else "-- steps/s"
        eta = _clock((total - step) / rate) if rate else "--:--"
        digits = len(str(total))
        return f"{step:>{digits}}/{total} [{bar}] {speed} ETA {eta}"

    def update(self, step: int, total: int) -> None:
        now = self._clock()
        if self._first is None:
            self._first = (step, now)
        self._step, self._total = step, total
        if not self._live or (step < total and now - self._drawn_at < self._interval):
            return
        self._drawn_at = now
        self._out.write("\r" + self.line(step, total, now))
        self._out.flush()

    def abort(self) -> None:
        """End a half-drawn bar's line, so an error message starts on its own."""
        if self._live and self._drawn_at > -float("inf"):
            self._out.write("\n")
            self._out.flush()

    def finish(self, note: str = "") -> None:
        """End the bar's line and write a summary: steps, time, rate."""
        now = self._clock()
        elapsed = now - self._start
        rate = self.rate(self._step, now)
        summary = f"{self._step}/{self._total} steps in {elapsed:.1f}s"
        if rate:
            summary += f" ({rate:.1f} steps/s)"
        if note:
            summary += f" {note}"
        self._out.write(("\r\x1b[2K" if self._live else "") + summary + "\n")
        self._out.flush()


# -- generate ------------------------------------------------------------------


def _model_params(model: StepModel, args: argparse.Namespace) -> dict[str, Any]:
    """The request's params from the flags and ``-p``; two that set one param differently: usage error."""
    declared = [p.name for p in model.params]
    if hasattr(model, "lora_names"):
        declared.append("loras")  # a list of {name, scale}: no Param kind, checked by the model
    params: dict[str, Any] = {}
    set_by: dict[str, str] = {}  # param -> the flag that set it, for a conflict's message

    def put(name: str, value: Any, flag: str) -> None:
        if name in params and params[name] != value:
            raise _UsageError(
                f"{flag} sets {name!r} to {json.dumps(value)} but {set_by[name]} sets it to "
                f"{json.dumps(params[name])}; give one"
            )
        params[name] = value
        set_by[name] = flag

    given = [(name, flag, getattr(args, name)) for name, flag in _PARAM_FLAGS]
    given += [(key, f"-p {key}={json.dumps(value)}", value) for key, value in args.param or ()]
    for name, flag, value in given:
        if value is None:
            continue
        if name == "output":
            put(name, value, flag)  # every request has it (omni_stream.model)
            continue
        if name == "size" and name not in declared and {"height", "width"} <= set(declared):
            put("height", value, flag)  # pipelines take the two sides
            put("width", value, flag)
            continue
        if name not in declared:
            raise _UsageError(
                f"model {model.name!r} takes no {name!r} param ({flag}); "
                f"its params: {', '.join(declared) or 'none'}"
            )
        put(name, value, flag)
    return params


async def _generate(
    model: StepModel,
    params: dict[str, Any],
    *,
    device: str,
    decoder: str,
    sink: Any,
    every: int,
    preview_size: int | None,
    progress: ProgressBar,
    checked: dict[str, Any],
) -> Any:
    """Run one request; ``checked`` receives its params as the model checked them."""
    from .engine import Engine
    from .preview import Previewer, PreviewSpec, should_preview

    previewer = Previewer()
    spec = None
    if sink is not None:
        spec = PreviewSpec(every=every, format=sink.format, max_size=preview_size, decoder=decoder)
    final = None
    async with Engine(model, device=device) as engine:
        stream = engine.stream(
            params, policy="all", preview_every=every if sink is not None else None
        )
        checked.update(stream.params)
        async with stream:
            async for frame in stream:
                progress.update(frame.step, frame.total)
                if (
                    spec is not None
                    and sink is not None
                    and not (frame.final and frame.decoded)
                    and should_preview(frame.step, frame.total, every)
                ):
                    # Rendered in a worker thread while the engine computes on.
                    try:
                        image = await previewer.render(frame, spec)
                    except ParamsError as exc:
                        raise _decoder_mismatch(decoder, exc) from None
                    sink.add(frame.step, image)
                final = frame
    return final


def _decoder_mismatch(decoder: str, exc: ParamsError) -> ParamsError:
    return ParamsError(
        f"cannot decode the model's frames with the {decoder!r} decoder: {exc}; "
        "pick another with --decoder",
        field="decoder",
    )


def _load_model(
    spec: str,
    preview_vae: str | None = None,
    loras: Mapping[str, str] | None = None,
    *,
    no_batch: bool = False,
    max_images: int | None = None,
) -> StepModel:
    """The model named by ``spec``, built now (:class:`_ModelLoader`'s arguments)."""
    return _ModelLoader.of(spec, preview_vae, loras, no_batch=no_batch, max_images=max_images)()


@dataclass(frozen=True, slots=True)
class _ModelLoader:
    """How to build the model named by ``spec``, with the command line's options: a value.

    ``serve --ray`` sends it to every replica, which calls it to build its
    model: Ray pickles it there, so it holds only its fields (a closure over
    the parsed arguments took their logging handler's lock along and failed
    to pickle). Make it with :meth:`of`, where the command runs: the
    environment's preview autoencoder is the command's, not a replica's.
    """

    spec: str
    #: The tiny preview autoencoder, and the option or variable that named it.
    preview_vae: str | None = None
    preview_vae_from: str = "--preview-vae"
    loras: tuple[tuple[str, str], ...] = ()
    no_batch: bool = False
    max_images: int | None = None

    @classmethod
    def of(
        cls,
        spec: str,
        preview_vae: str | None = None,
        loras: Mapping[str, str] | None = None,
        *,
        no_batch: bool = False,
        max_images: int | None = None,
    ) -> _ModelLoader:
        """``spec`` with the LoRAs (``{name: path}``), ``no_batch`` (one request per model call:
        a diffusers pipeline's results then equal ``pipe()``'s bit for bit whatever else runs),
        ``max_images`` (the most images a request may ask for, ``num_images``) and the preview
        autoencoder, else ``$OMNI_STREAM_PREVIEW_VAE``'s."""
        from .config import PREVIEW_VAE_ENV, preview_vae as env_preview_vae

        pairs = tuple((loras or {}).items())
        if preview_vae:
            return cls(spec, preview_vae, "--preview-vae", pairs, no_batch, max_images)
        return cls(spec, env_preview_vae(), PREVIEW_VAE_ENV, pairs, no_batch, max_images)

    def __call__(self) -> StepModel:
        """A new model; raises ParamsError for a spec that does not load, _UsageError for an
        option the model does not take."""
        from .models.registry import load_model

        spec = self.spec
        try:
            model = load_model(spec)
        except OmniStreamError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's factory may raise anything
            raise ParamsError(
                f"model {spec!r} failed to load: {type(exc).__name__}: {exc}", field="model"
            ) from exc
        if self.preview_vae:
            flag, vae = self.preview_vae_from, self.preview_vae
            use = getattr(model, "use_preview_vae", None)
            if use is None:
                raise _UsageError(f"{flag}: model {spec!r} has no latents for a tiny autoencoder to decode; "
                                  "it works with diffusers:... models")
            try:
                use(vae)
            except (ImportError, ValueError, OSError) as exc:
                raise _UsageError(f"{flag} {vae!r}: {_describe_error(exc)}") from exc
        if self.loras:
            load = getattr(model, "load_loras", None)
            if load is None:
                raise _UsageError(
                    f"--lora: model {spec!r} takes no LoRAs; they work with diffusers:... models"
                )
            try:
                load(dict(self.loras))
            except (ImportError, ValueError, OSError) as exc:
                raise _UsageError(f"--lora: {_describe_error(exc)}") from exc
        if self.no_batch:
            model.max_batch_size = 1  # the engine reads it when it starts
        if self.max_images is not None:
            limit = getattr(model, "set_max_images", None)
            if limit is None:
                raise _UsageError(f"--max-images: model {spec!r} makes one image a request; "
                                  "mixture and diffusers:... image models make several")
            try:
                limit(self.max_images)
            except ParamsError as exc:
                raise _UsageError(f"--max-images: {exc}") from None
        return model


def _cmd_generate(args: argparse.Namespace) -> int:
    from .preview import PreviewWriter, check_output_path, decoder_for, default_decoder

    output = Path(args.output)
    try:
        check_output_path(output)
    except ValueError as exc:
        raise _UsageError(f"-o {str(output)!r}: {exc}") from None
    if args.every is not None and not args.previews:
        raise _UsageError("--every needs --previews")
    decoder_for(args.decoder)  # fail before the model loads
    sink = None
    if args.previews:
        try:
            sink = PreviewWriter(args.previews)
        except (ValueError, ImportError) as exc:
            raise _UsageError(f"--previews: {_describe_error(exc)}") from None
    # Which model was loaded and how it runs (a pipeline's native or callback mode).
    args.log.show_info("omni_stream.models")
    # A request here is the whole run: whatever count it asks for is allowed.
    wanted = args.num_images if args.num_images is not None and args.num_images > 4 else None
    model = _load_model(args.model, args.preview_vae, _loras(args), max_images=wanted)
    params = _model_params(model, args)
    # Checked here for an early error; the engine gets the params as given
    # (validating a validated dict twice is not always the same: size vs
    # height and width, decoded input images).
    rest, _ = split_output(model, params)
    model.validate(rest)
    decoder = default_decoder(model) if args.decoder == "auto" else args.decoder
    progress = ProgressBar(sys.stderr, live=sys.stderr.isatty())
    checked: dict[str, Any] = {}
    try:
        final = run(
            functools.partial(
                _generate,
                model,
                params,
                device=args.device,
                decoder=decoder,
                sink=sink,
                every=args.every or 1,
                preview_size=args.preview_size or None,
                progress=progress,
                checked=checked,
            )
        )
        try:
            # The result at full size; a PNG says how it was made. Several
            # images (--num-images): one file each, out.png -> out-0.png, ...
            meta = {"model": args.model, **checked}
            parts = final.split()
            paths = [output] if len(parts) == 1 else [
                output.with_name(f"{output.stem}-{i}{output.suffix}") for i in range(len(parts))
            ]
            saved = [
                part.save(path, params=meta, decoder=decoder) for part, path in zip(parts, paths, strict=True)
            ]
        except ParamsError as exc:
            raise _decoder_mismatch(decoder, exc) from None
        except ValueError as exc:
            raise _UsageError(f"-o {str(output)!r}: {exc}") from None
        where = str(saved[0]) if len(saved) == 1 else f"{saved[0]} ... {saved[-1].name}"
        note = f"-> {where} ({_picture_size(parts[0])}{f', {len(saved)} images' if len(saved) > 1 else ''})"
        if isinstance(checked.get("seed"), int):
            # Drawn when none was given: the one to pass again for the same picture.
            note += f", seed {checked['seed']}"
        if sink is not None:
            sink.close()
            note += f", {sink.written} previews -> {sink.path}"
    except BaseException:
        progress.abort()
        raise
    progress.finish(note)
    return 0


def _picture_size(frame: Any) -> str:
    images = frame.images()
    first = images[0]
    size = f"{first.width}x{first.height}"
    return f"{len(images)} frames of {size}" if frame.is_video else size


# -- models --------------------------------------------------------------------


def _number(value: float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _format_param(row: dict[str, Any]) -> str:
    parts = [f"  {row['name']:<10} {row['kind']:<6} default={json.dumps(row['default'])}"]
    lo, hi = row.get("minimum"), row.get("maximum")
    if lo is not None and hi is not None:
        parts.append(f"range={_number(lo)}..{_number(hi)}")
    elif lo is not None:
        parts.append(f"range>={_number(lo)}")
    elif hi is not None:
        parts.append(f"range<={_number(hi)}")
    if "choices" in row:
        parts.append(f"choices={','.join(row['choices'])}")
    if row.get("help"):
        parts.append(f"  {row['help']}")
    return " ".join(parts)


def _preview_default(model: StepModel) -> str:
    from .preview import default_decoder

    return default_decoder(model)


def _cmd_models(args: argparse.Namespace) -> int:
    from .models.registry import BUILTIN_MODELS
    from .params import describe

    given = [_named_spec(n) for n in args.names or list(BUILTIN_MODELS)]
    names = [spec for _, spec in given]
    unknown = [n for n in names if n not in BUILTIN_MODELS and ":" not in n]
    if unknown:
        raise _UsageError(
            f"unknown model(s) {', '.join(map(repr, unknown))}; "
            f"built-in: {', '.join(BUILTIN_MODELS)}, or diffusers:ID|PATH, or module:attr"
        )
    default = next(iter(BUILTIN_MODELS))
    named = any(served is not None for served, _ in given)
    rows: list[dict[str, Any]] = []
    # Each model is made only when listed: a missing optional dependency of
    # one must not hide the others.
    for served, name in given:
        try:
            model = BUILTIN_MODELS[name]() if name in BUILTIN_MODELS else _load_model(name)
        except Exception as exc:  # noqa: BLE001 - reported, and the listing goes on
            first = (served, name) == given[0] if named else name == default
            rows.append({"name": served or name, "default": first, "error": _describe_error(exc)})
            continue
        rows.append(
            {
                # NAME=SPEC: the name a request's `model` takes on `serve --model NAME=SPEC`.
                "name": served or name,
                "spec": name,
                # With NAME=SPEC, as serve takes them: the first is the default.
                "default": (served, name) == given[0] if named else name == default,
                "description": model.describe(),
                "preview_decoder": _preview_default(model),
                "params": describe(model.params),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        mark = " (default)" if row["default"] else ""
        if "error" in row:
            print(f"{row['name']}{mark}: unavailable: {row['error']}")
            continue
        print(f"{row['name']}{mark}: {row['description']}")
        for param in row["params"]:
            print(_format_param(param))
    if not args.names:
        print(_DIFFUSERS_LINE)
    return 0


# -- serve ---------------------------------------------------------------------


def _named_spec(text: str) -> tuple[str | None, str]:
    """``NAME=SPEC`` as (NAME, SPEC); a plain SPEC as (None, SPEC). A spec may hold ``=``
    itself (a path): only a left part that is a model name (no ``:`` or ``/``) names it."""
    from .ids import MODEL_NAME

    name, sep, spec = text.partition("=")
    if sep and MODEL_NAME.fullmatch(name):
        return name, spec
    return None, text


def _served_specs(given: list[str]) -> list[tuple[str, str]]:
    """Each ``--model`` as (name, spec); one plain SPEC is named after the model it makes."""
    named = [_named_spec(text) for text in given]
    if len(named) == 1 and named[0][0] is None:
        return [("", named[0][1])]
    out: dict[str, str] = {}
    for (name, spec), text in zip(named, given, strict=True):
        if name is None:
            raise _UsageError(f"--model {text!r}: with several --model, give each a name: NAME=SPEC")
        if not spec:
            raise _UsageError(f"--model {text!r}: no SPEC after {name}=")
        if name in out:
            raise _UsageError(f"--model: the name {name!r} is given twice")
        out[name] = spec
    return list(out.items())


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
    _UsageError for one given without --ray, where nothing would read it."""
    for name in ("max_handovers", "checkpoint_max_bytes"):
        if getattr(args, name) is not None and not args.ray:
            option = "--" + name.replace("_", "-")
            raise _UsageError(f"{option} is for --ray: a lost replica's requests handed over to another")
    names = ("checkpoint_every", "max_handovers", "checkpoint_max_bytes")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _cmd_serve(args: argparse.Namespace) -> int:
    # A server's operator wants its lifecycle lines (the model loaded and its
    # mode, the URL it listens on, shutdown), not only warnings: from before
    # the model loads.
    args.log.show_info("omni_stream")
    # Several --token (named: NAME=SECRET) serve several tenants; none: $OMNI_STREAM_TOKEN.
    token: Any = (args.token[0] if len(args.token) == 1 else list(args.token)) if args.token else env_token()
    from .engine.group import names_group

    loras = _loras(args)  # a bad folder or a name twice: said before anything loads
    specs = _served_specs(args.model or ["mixture"])
    if args.max_loaded is not None and not specs[0][0]:
        raise _UsageError("--max-loaded bounds the models loaded at once: give them as --model NAME=SPEC")
    residency = [f for f, v in (("--min-residency", args.min_residency),
                                ("--max-swaps-per-min", args.max_swaps_per_min)) if v is not None]
    if residency and args.max_loaded is None:
        raise _UsageError(f"{' and '.join(residency)} pace model switches: give --max-loaded too")
    if residency and args.ray:
        raise _UsageError(
            f"{' and '.join(residency)} apply to this server's models; Ray replicas read "
            "OMNI_STREAM_MIN_RESIDENCY and OMNI_STREAM_MAX_SWAPS_PER_MIN from their environment"
        )
    if args.loop == "trio" and args.ray:
        # Ray's client runs on asyncio only; the engines in this process run on any loop.
        raise _UsageError("--loop trio serves engines in this process; --ray needs asyncio (or uvloop)")
    handover = _handover_options(args)

    # Values, not closures: with --ray they are pickled to every replica, which builds its models.
    loaders = {
        name: _ModelLoader.of(
            spec, args.preview_vae, loras, no_batch=args.no_batch, max_images=args.max_images
        )
        for name, spec in specs
    }
    load = next(iter(loaders.values()))

    # The engine's scheduling (engine/scheduler.py): for the engines made here or in replicas.
    engine_options = {k: getattr(args, k) for k in ("scheduling", "quantum") if getattr(args, k) is not None}
    model: Any
    if specs[0][0] and args.ray:  # named, over Ray: each replica serves them, routed by model
        if names_group(args.device):
            raise _UsageError(
                "--ray runs one engine per model on each replica: give one --device (auto: the replica's GPU)"
            )
        try:
            from .integrations.ray_serve import deploy
        except ImportError as exc:
            _error(f"--ray needs Ray Serve: pip install 'omni-stream[ray]' ({exc})")
            return 2
        # Each replica builds every model with its factory; --max-loaded bounds
        # those on its device (loaded on demand, Serve routing by model).
        model = deploy(
            loaders,
            max_models_per_replica=args.max_loaded, replicas=args.replicas, num_gpus=args.num_gpus,
            address=args.ray_address, engine_kwargs={"device": args.device, **engine_options},
            **handover,
        )
    elif specs[0][0]:  # named: a request's `model` picks one
        if names_group(args.device):
            raise _UsageError(
                "several --model run one engine each on one device, in this process: "
                "not with a --device list (yet)"
            )
        from .engine.router import ModelRouter

        # Every model is built now (host memory; its params known); --max-loaded
        # bounds those on the device at once, loading the others on demand.
        model = ModelRouter({name: loader() for name, loader in loaders.items()}, max_loaded=args.max_loaded,
                            min_residency_s=args.min_residency, max_swaps_per_min=args.max_swaps_per_min,
                            device=args.device, **engine_options)
    elif args.ray:
        if names_group(args.device):
            raise _UsageError(
                "--ray runs one engine per replica: give one --device (auto: the replica's GPU)"
            )
        try:
            from .integrations.ray_serve import deploy
        except ImportError as exc:
            _error(f"--ray needs Ray Serve: pip install 'omni-stream[ray]' ({exc})")
            return 2
        # The replicas build the model; this process only serves in front of them.
        model = deploy(
            load, replicas=args.replicas, num_gpus=args.num_gpus, address=args.ray_address,
            engine_kwargs={"device": args.device, **engine_options}, **handover,
        )
    else:
        # A group builds one model per device with the factory (before it listens).
        model = load if names_group(args.device) else load()
    from .errors import EngineDeadError

    serve: Callable[..., object]  # blocking, or a coroutine to run (the CLI's tests' stand-in)
    try:
        from .server import serve
    except ImportError as exc:
        _error(f"the server is unavailable: {exc}")
        return 1
    server_failed: tuple[type[BaseException], ...] = ()
    try:
        from .server.app import ServerFailedError
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
        _error(f"the server stopped with a stray cancellation: {_describe_error(exc)}")
        return 1
    return 0


# -- bench ---------------------------------------------------------------------


def _cmd_bench(rest: Sequence[str]) -> int:
    # benchmarks/ ships with the repository, not with the installed package.
    root = Path.cwd()
    if not (root / "benchmarks" / "__main__.py").is_file():
        _error(
            f"no benchmarks/ package in {root}; run `{PROG} bench` from the root of "
            "an omni_stream checkout"
        )
        return 2
    return subprocess.call([sys.executable, "-m", "benchmarks", *rest], cwd=root)


# -- the parser ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``omni-stream`` argument parser."""
    parser = _Parser(prog=PROG, description="Stream every step of generation.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log more, with tracebacks (give it before COMMAND)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    # Every subcommand's --help shows the defaults.
    helpful: dict[str, Any] = {"formatter_class": _DefaultsFormatter}

    gen = sub.add_parser("generate", help="run one request and write its result", **helpful)
    gen.add_argument("prompt", nargs="?", metavar="PROMPT",
                     help="the prompt (for models with a 'prompt' param)")
    gen.add_argument("--steps", type=_positive_int, help="denoising steps")
    gen.add_argument("--size", type=_positive_int, metavar="PX", help="image side in pixels")
    gen.add_argument("--seed", type=_seed, help="random seed; -1 or none: a random one, said at the end")
    gen.add_argument("--sampler", metavar="NAME", help="sampler name")
    gen.add_argument("--num-images", type=_positive_int, metavar="N",
                     help="images from the prompt (diffusers models): written as OUT-0.png, OUT-1.png, ...")
    gen.add_argument("-p", "--param", type=_key_value, action="append", metavar="KEY=JSON",
                     help="any other model param, e.g. -p 'shape=[3,64,64]' (repeatable)")
    gen.add_argument("--model", default="mixture", metavar="SPEC", help=_MODEL_HELP)
    gen.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or sim")
    gen.add_argument("--decoder", default="auto",
                     help="preview decoder: auto (the model's, else by the frame's shape), "
                     "rgb, sd15, sdxl, sd3, flux")
    gen.add_argument("--preview-vae", metavar="PATH|ID", default=None, help=_PREVIEW_VAE_HELP)
    _add_lora_args(gen)
    gen.add_argument("--previews", metavar="OUT.gif|.webp|.mp4|DIR",
                     help="write previews: an animated GIF or WebP, an MP4 (the video extra), "
                     "or a folder of numbered PNGs (a path without a suffix)")
    gen.add_argument("--every", type=_positive_int, metavar="N",
                     help="preview every Nth step (and the last); default 1")
    gen.add_argument("--preview-size", type=_non_negative_int, default=512, metavar="PX",
                     help="shrink previews to fit PX on the longer side; 0 keeps full size")
    gen.add_argument("-o", "--output", default="out.png", metavar="OUT",
                     help="the result: .png (with the params in its metadata), .jpg, .webp; "
                     "a video model's: .mp4, .webp, .gif; -p output=latent saves the "
                     "final latent's preview instead")
    gen.set_defaults(handler=_cmd_generate)

    srv = sub.add_parser(
        "serve", help="serve the page, the HTTP API, event streams and the websocket on one port", **helpful
    )
    srv.add_argument("--model", action="append", metavar="[NAME=]SPEC",
                     help=_MODEL_HELP + "; repeat as NAME=SPEC to serve several, a request's "
                     "'model' naming one (default: the first; default SPEC: mixture)")
    srv.add_argument("--scheduling", choices=POLICIES, default=None,
                     help="which requests step first: preemptive (the default: the shortest remaining work, "
                     "aged), round-robin, fcfs (docs/design.md, 'Scheduling and batching')")
    srv.add_argument("--quantum", type=_positive_int, metavar="N", default=None,
                     help="preemptive: the rounds a running request keeps its place (default 1)")
    srv.add_argument("--max-loaded", type=_positive_int, metavar="N", default=None,
                     help="with several --model: at most N on the device at once, the others loaded "
                     "when a request needs them (least recently used unloaded); default: all, at start; "
                     "with --ray, per replica")
    srv.add_argument("--min-residency", type=_non_negative_seconds, metavar="S", default=None,
                     help="with --max-loaded: seconds a model keeps the device once loaded, and after its "
                     "last request, before another may take it (default: $OMNI_STREAM_MIN_RESIDENCY, "
                     "else 2.0)")
    srv.add_argument("--max-swaps-per-min", type=_positive_int, metavar="N", default=None,
                     help="with --max-loaded: the most model switches in any minute "
                     "(default: $OMNI_STREAM_MAX_SWAPS_PER_MIN, else 6)")
    srv.add_argument("--preview-vae", metavar="PATH|ID", default=None, help=_PREVIEW_VAE_HELP)
    _add_lora_args(srv)
    srv.add_argument("--max-images", type=_positive_int, metavar="N", default=None,
                     help="the most images one request may ask for with num_images (diffusers and "
                     "mixture models; default 4)")
    srv.add_argument("--no-batch", action="store_true",
                     help="run each request alone: no batching across requests (a diffusers model's "
                     "results then equal pipe()'s bit for bit whatever else runs)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=_port, default=8765, help="port to listen on; 0 picks a free one")
    srv.add_argument("--token", action="append", metavar="[NAME=]SECRET",
                     help=f"bearer token clients must send on every route but /health and the page "
                     f"(default: ${TOKEN_ENV}); repeat with NAME=SECRET for several tenants, each its own "
                     "principal (docs/protocol.md, Security)")
    srv.add_argument("--tokens-file", metavar="PATH", default=None,
                     help="a file of NAME=SECRET [priority=N] lines, one tenant each "
                     "(default: $OMNI_STREAM_TOKENS_FILE)")
    srv.add_argument("--allowed-host", action="append", metavar="NAME",
                     help="a host name the server answers to besides its address (repeatable; "
                     "default: $OMNI_STREAM_ALLOWED_HOSTS)")
    srv.add_argument("--trusted-proxy", action="append", metavar="ADDR",
                     help="a proxy (address or network) whose X-Forwarded-For names the client "
                     "(repeatable; default: $OMNI_STREAM_TRUSTED_PROXIES)")
    srv.add_argument("--metrics-public", action="store_true",
                     help="serve /metrics without the token (for a scraper that cannot send one)")
    srv.add_argument("--allow-origin", action="append", metavar="ORIGIN",
                     help="a browser Origin allowed to connect (repeatable)")
    srv.add_argument("--webhook-allow", action="append", metavar="PATTERN",
                     help="a URL a request's webhook may call, '*' at the end matching the rest "
                     "('https://hooks.example.com/*'; repeatable; default: $OMNI_STREAM_WEBHOOK_ALLOW; "
                     "none: webhooks are refused; docs/webhooks.md)")
    srv.add_argument("--webhook-secret", metavar="whsec_...", default=None,
                     help="the secret webhooks are signed with, Standard Webhooks' whsec_ base64 form "
                     "(default: $OMNI_STREAM_WEBHOOK_SECRET, else one made up and logged at start)")
    srv.add_argument("--state-dir", metavar="DIR", default=None,
                     help="write every accepted request, its checkpoints and its results to DIR, and "
                     "after a crash or restart resume the unfinished ones and serve the finished ones "
                     "(default: $OMNI_STREAM_STATE_DIR; none: nothing survives the process; with --ray, "
                     "the server in front writes the checkpoints its replicas send; "
                     "docs/reliability.md, The state directory)")
    srv.add_argument("--checkpoint-every", type=_positive_int, metavar="N", default=None,
                     help="with --state-dir: checkpoint a request every N steps, for models that can "
                     "(default: $OMNI_STREAM_CHECKPOINT_EVERY, else 10); with --ray, also the steps between "
                     "two checkpoints a replica sends the server, from which a lost replica's requests "
                     "go on on another (default 10)")
    srv.add_argument("--checkpoint-seconds", type=float, metavar="T", default=None,
                     help="with --state-dir: write at most one checkpoint every T seconds per request "
                     "(default: $OMNI_STREAM_CHECKPOINT_SECONDS, else no such floor)")
    srv.add_argument("--state-max-bytes", type=_positive_int, metavar="BYTES", default=None,
                     help="with --state-dir: what DIR may hold; the oldest finished requests are "
                     "deleted to make room (default: $OMNI_STREAM_STATE_MAX_BYTES, else 2 GiB)")
    srv.add_argument("--device", default="auto",
                     help="auto, cpu, cuda, cuda:N or sim; several (cuda:0,cuda:1) or 'all' "
                     "serve one engine group, a model per device")
    srv.add_argument("--ray", action="store_true",
                     help="run the model as Ray Serve replicas, one engine each, and serve in front "
                     "of them (the ray extra; docs/scale-out.md)")
    srv.add_argument("--ray-address", metavar="ADDR", default=None,
                     help="with --ray: the Ray cluster (auto, HOST:6379); default $RAY_ADDRESS, "
                     "else a local Ray")
    srv.add_argument("--replicas", type=_positive_int, default=1, metavar="N",
                     help="with --ray: replicas")
    srv.add_argument("--num-gpus", type=float, default=0.0, metavar="G",
                     help="with --ray: GPUs per replica; a fraction packs several on one GPU")
    srv.add_argument("--max-handovers", type=_non_negative_int, metavar="N", default=None,
                     help="with --ray: the most times one request is handed over to another replica when "
                     "its replica dies (default 2; 0: never, its requests fail, and no checkpoints are sent)")
    srv.add_argument("--checkpoint-max-bytes", type=_non_negative_int, metavar="BYTES", default=None,
                     help="with --ray: the bytes of checkpoints the server keeps for hand-overs, all "
                     "requests together; past it the oldest are dropped, and theirs start again from "
                     "step 0 (default 268435456, 256 MiB; 0: none kept, none sent)")
    srv.add_argument("--loop", choices=LOOPS, default=None,
                     help="the event loop: uvloop (the default where installed), asyncio (both serve "
                     "on uvicorn), or trio (served by hypercorn: pip install 'omni-stream[trio]'; "
                     "not with --ray)")
    srv.add_argument("--stay-dead", action="store_true",
                     help="keep running (/health 503) when the engine dies, for debugging; "
                     f"by default the server shuts down and exits with status {EXIT_ENGINE_DEAD}")
    srv.set_defaults(handler=_cmd_serve)

    mod = sub.add_parser("models", help="list the models and their params", **helpful)
    mod.add_argument("names", nargs="*", metavar="SPEC",
                     help="only these: built-in names, diffusers:ID|PATH or module:attr")
    mod.add_argument("--json", action="store_true", help="print JSON")
    mod.set_defaults(handler=_cmd_models)

    # Listed for --help only: main() hands everything after "bench" to
    # `python -m benchmarks` untouched (argparse would eat its options).
    sub.add_parser("bench", help="run the benchmark suite (python -m benchmarks ARGS...)",
                   add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    verbose = bool({"-v", "--verbose"} & set(args_list[:1]))
    with _CliLogging(verbose) as log:
        return _main(args_list, log)


def _main(args_list: list[str], log: _CliLogging) -> int:
    try:
        command_at = 1 if args_list[:1] in (["-v"], ["--verbose"]) else 0
        if args_list[command_at : command_at + 1] == ["bench"]:
            return _cmd_bench(args_list[command_at + 1 :])
        parser = build_parser()
        try:
            args = parser.parse_args(args_list)
        except SystemExit as exc:  # --help, --version, or a usage error
            return exc.code if isinstance(exc.code, int) else 2
        handler = getattr(args, "handler", None)
        if handler is None:
            parser.print_help(sys.stderr)
            return 2
        args.log = log
        return int(handler(args))
    except _UsageError as exc:
        _error(str(exc))
        return 2
    except ParamsError as exc:
        _error(_describe_error(exc))
        return 2
    except OmniStreamError as exc:
        _error(_describe_error(exc))
        return 1
    except OSError as exc:
        _error(f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
        return 1
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130


def entry(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``omni-stream`` command: :func:`main`, then end the process with its status.

    Everything of ours is finished when ``main`` returns (the engine closed,
    its producer thread done, files closed), but a thread that ran torch code
    may still be tearing down its native per-thread state. A normal exit runs
    C++ static destructors beside it, and one that finds a native thread still
    running aborts the process ("terminate called without an active exception",
    status 134): seen on about 1 in 8 Ctrl-Cs under CPU load, where nothing
    (saving the result) stands between the engine's close and the exit. So the
    process ends deliberately, once its output is flushed, without running
    native destructors. Not after Ray was used: its exit hooks stop the
    local cluster it started.
    """
    status = main(argv)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe must not change the status
            stream.flush()
    if "ray" in sys.modules:
        sys.exit(status)
    logging.shutdown()
    os._exit(status)


if __name__ == "__main__":  # pragma: no cover
    # `python -m omni_stream.cli` runs this file as __main__; the command runs from the module
    # as imported, whose classes (_ModelLoader) pickle by reference to Ray's replicas.
    from omni_stream.cli import entry as _entry

    _entry()
