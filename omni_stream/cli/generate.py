"""``omni-stream generate``: one request run here, its previews and its result written."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

from ..config import run
from ..errors import ParamsError
from ..model import StepModel, split_output
from .console import UsageError, describe_error
from .loader import build_model, check_model_configs
from .loras import lora_options
from .progress import ProgressBar

__all__ = ["cmd_generate"]

# CLI flag -> the model param it sets; passed only when the model declares it.
_PARAM_FLAGS = (
    ("prompt", "PROMPT"),
    ("steps", "--steps"),
    ("size", "--size"),
    ("seed", "--seed"),
    ("sampler", "--sampler"),
    ("num_images", "--num-images"),
)


def _model_params(model: StepModel, args: argparse.Namespace) -> dict[str, Any]:
    """The request's params from the flags and ``-p``; two that set one param differently: usage error."""
    declared = [p.name for p in model.params]
    if hasattr(model, "lora_names"):
        declared.append("loras")  # a list of {name, scale}: no Param kind, checked by the model
    params: dict[str, Any] = {}
    set_by: dict[str, str] = {}  # param -> the flag that set it, for a conflict's message

    def put(name: str, value: Any, flag: str) -> None:
        if name in params and params[name] != value:
            raise UsageError(
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
            raise UsageError(
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
    from ..engine import Engine
    from ..preview import Previewer, PreviewSpec, should_preview

    previewer = Previewer()
    spec = None
    if sink is not None:
        spec = PreviewSpec(every=every, format=sink.format, max_size=preview_size, decoder=decoder)
    final = None
    async with Engine(model, device=device) as engine:
        stream = engine.stream(params, policy="all", preview_every=every if sink is not None else None)
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
        f"cannot decode the model's frames with the {decoder!r} decoder: {exc}; pick another with --decoder",
        field="decoder",
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from ..preview import PreviewWriter, check_output_path, decoder_for, default_decoder

    output = Path(args.output)
    try:
        check_output_path(output)
    except ValueError as exc:
        raise UsageError(f"-o {str(output)!r}: {exc}") from None
    if args.every is not None and not args.previews:
        raise UsageError("--every needs --previews")
    decoder_for(args.decoder)  # fail before the model loads
    sink = None
    if args.previews:
        try:
            sink = PreviewWriter(args.previews)
        except (ValueError, ImportError) as exc:
            raise UsageError(f"--previews: {describe_error(exc)}") from None
    # Which model was loaded and how it runs (a pipeline's native or callback mode).
    args.log.show_info("omni_stream.models")
    # A request here is the whole run: whatever count it asks for is allowed.
    wanted = args.num_images if args.num_images is not None and args.num_images > 4 else None
    loras = lora_options(args)
    bound = [option for (model_name, _), option in loras.sources.items() if model_name]
    if bound:
        raise UsageError(f"{bound[0]}: generate runs one model: give its LoRAs without MODEL")
    model = build_model(
        args.model,
        args.preview_vae,
        loras.shared,
        max_images=wanted,
        model_configs=check_model_configs(args.model_config or ()),
    )
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
            hashes = getattr(model, "weight_hashes", None)
            found = hashes(checked) if callable(hashes) else None
            if found:
                meta["hashes"] = found  # A1111's Model hash and Lora hashes, for the infotext
            parts = final.split()
            paths = (
                [output]
                if len(parts) == 1
                else [output.with_name(f"{output.stem}-{i}{output.suffix}") for i in range(len(parts))]
            )
            saved = [
                part.save(path, params=meta, decoder=decoder) for part, path in zip(parts, paths, strict=True)
            ]
        except ParamsError as exc:
            raise _decoder_mismatch(decoder, exc) from None
        except ValueError as exc:
            raise UsageError(f"-o {str(output)!r}: {exc}") from None
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
