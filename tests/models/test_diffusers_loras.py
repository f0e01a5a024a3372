"""LoRAs per request: loaded once, named with a scale, equal to ``pipe()`` with ``set_adapters``.

The LoRA is made here: peft adapters with random weights on the tiny UNet
(``init_lora_weights=False``, so it changes the picture), saved with
diffusers' ``save_lora_weights`` and loaded back as a user's would be.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from diffusers import StableDiffusionPipeline  # noqa: E402

import omni_stream as om  # noqa: E402
from omni_stream.models.diffusers import Diffusers  # noqa: E402
from omni_stream.models.diffusers.loras import MAX_SCALE, check_loras, lora_dir  # noqa: E402

from . import test_diffusers as sd  # noqa: E402
from . import test_diffusers_callback as cb  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def make_lora(folder: Path, seed: int) -> Path:
    """A LoRA for the tiny UNet's attention, random weights, saved as diffusers saves them."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    unet = sd.tiny_unet()
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    folder.mkdir(parents=True, exist_ok=True)
    StableDiffusionPipeline.save_lora_weights(
        folder, unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    )
    return folder


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {"ink": make_lora(root / "ink", 7), "pastel": make_lora(root / "pastel", 8)}


def reference(loras: dict[str, Path], raw: dict[str, Any], chosen: list[tuple[str, float]]) -> torch.Tensor:
    """``pipe()`` with the LoRAs loaded and ``set_adapters`` at those scales (none: disabled)."""
    pipe = sd.sd_pipe()
    for name, path in loras.items():
        pipe.load_lora_weights(str(path), adapter_name=name)
    if chosen:
        pipe.set_adapters([n for n, _ in chosen], adapter_weights=[s for _, s in chosen])
    else:
        pipe.disable_lora()
    return sd.reference(pipe, raw)[0]


RAW = dict(prompt="a cat", negative_prompt="blur", steps=3, seed=5, height=16, width=16)


def model_with(loras: dict[str, Path], **options: Any) -> Any:
    model = Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings, **options)
    model.load_loras(loras)
    return model


@pytest.mark.parametrize("scale", [0.0, 0.5, 1.0])
def test_a_request_with_a_lora_equals_the_pipeline_with_set_adapters_at_that_scale(
    loras: dict[str, Path], scale: float
) -> None:
    model = model_with(loras)
    assert model.lora_names == ("ink", "pastel")
    got = sd.run(model, dict(RAW, loras=[{"name": "ink", "scale": scale}]))[-1]
    assert torch.equal(got, reference(loras, RAW, [("ink", scale)]))


def test_two_loras_at_once_and_none_at_all(loras: dict[str, Path]) -> None:
    model = model_with(loras)
    both = sd.run(model, dict(RAW, loras=[{"name": "pastel", "scale": 0.7}, {"name": "ink", "scale": 0.4}]))[-1]
    assert torch.equal(both, reference(loras, RAW, [("ink", 0.4), ("pastel", 0.7)]))
    # Without LoRAs: what the pipeline gives with none loaded at all, bit for bit.
    plain = sd.run(model, RAW)[-1]
    assert torch.equal(plain, sd.reference(sd.sd_pipe(), RAW)[0])
    assert not torch.equal(plain, both)


def test_requests_with_other_loras_interleave_each_as_if_alone(loras: dict[str, Path]) -> None:
    model = model_with(loras, max_batch_size=4)
    a = model.validate(dict(RAW, loras=[{"name": "ink", "scale": 1.0}]))
    b = model.validate(dict(RAW, seed=6))
    c = model.validate(dict(RAW, loras=[{"name": "ink"}]))  # scale 1 by default: a's set
    assert model.batch_key(a) != model.batch_key(b) and model.batch_key(a) == model.batch_key(c)
    sa, sb = model.start(a, sd.CPU), model.start(b, sd.CPU)
    switches = model._loras.switches
    for _ in range(3):
        fa = model.step([sa])[0]
        fb = model.step([sb])[0]
    assert model._loras.switches - switches == 6  # one set_adapters / disable_lora per switch
    assert torch.equal(fa, reference(loras, RAW, [("ink", 1.0)]))
    assert torch.equal(fb, reference(loras, dict(RAW, seed=6), []))


@pytest.mark.parametrize(
    ("value", "field", "words"),
    [
        ([{"name": "oil", "scale": 1}], "loras[0].name", "known: ink, pastel"),
        ([{"name": "ink", "scale": MAX_SCALE + 1}], "loras[0].scale", "from -4 to 4"),
        ([{"name": "ink", "scale": "strong"}], "loras[0].scale", "must be a number"),
        ([{"name": "ink"}, {"name": "ink"}], "loras[1].name", "named twice"),
        ([{"name": "ink", "weight": 1}], "loras[0].weight", "unknown key"),
        ("ink", "loras", "must be a list"),
        ([{"name": "ink"}] * 9, "loras", "at most 8"),
    ],
)
def test_bad_loras_are_params_errors_naming_the_entry(
    loras: dict[str, Path], value: Any, field: str, words: str
) -> None:
    model = model_with(loras)
    with pytest.raises(om.ParamsError) as info:
        model.validate(dict(RAW, loras=value))
    assert info.value.field == field and words in info.value.message, info.value.message


def test_a_model_without_loras_refuses_any_and_says_how_to_load_them() -> None:
    with pytest.raises(om.ParamsError, match="serve --lora NAME=PATH"):
        check_loras([{"name": "ink"}], (), model="diffusers")
    assert check_loras(None, (), model="diffusers") == () == check_loras([], (), model="diffusers")


def test_loading_twice_or_from_nowhere_says_which(loras: dict[str, Path], tmp_path: Path) -> None:
    model = model_with(loras)
    with pytest.raises(ValueError, match="'ink' is loaded already"):
        model.load_loras({"ink": loras["ink"]})
    with pytest.raises(ValueError, match="'gone'"):
        model.load_loras({"gone": tmp_path / "missing"})


def test_lora_dir_names_each_by_its_file_or_folder(loras: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    copy_file = tmp_path / "watercolour.safetensors"
    copy_file.write_bytes((loras["ink"] / "pytorch_lora_weights.safetensors").read_bytes())
    assert lora_dir(loras["ink"].parent) == {"ink": str(loras["ink"]), "pastel": str(loras["pastel"])}
    assert lora_dir(tmp_path) == {"watercolour": str(copy_file)}
    with pytest.raises(ValueError, match="holds no LoRA"):
        lora_dir(tmp_path / "sub")


def test_a_callback_mode_request_runs_the_pipeline_with_its_loras(loras: dict[str, Path], tmp_path: Path) -> None:
    encoder = cb.make_text_encoder(tmp_path)
    pipe = cb.img2img_pipe(encoder)
    model = Diffusers(pipe, mode="callback")
    model.load_loras(loras)
    image = cb.picture()
    raw = dict(cb.IMG2IMG, image=cb.data_url(image), loras=[{"name": "pastel", "scale": 0.5}])
    got = cb.run_direct(model, raw, output="latent").frames[-1]
    ref = copy.copy(pipe)
    ref.set_adapters(["pastel"], adapter_weights=[0.5])
    expected, _ = cb.img2img_reference(ref, cb.IMG2IMG, image, "latent")
    assert torch.equal(got, expected.images[0])
    # The next request without LoRAs: the adapters are off again.
    plain = cb.run_direct(model, dict(cb.IMG2IMG, image=cb.data_url(image)), output="latent").frames[-1]
    pipe.disable_lora()
    assert torch.equal(plain, cb.img2img_reference(pipe, cb.IMG2IMG, image, "latent")[0].images[0])


def test_a_switch_that_fails_half_way_leaves_the_next_request_its_own_set(
    loras: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # enable_lora() ran, set_adapters() raised: the bank still believed "none" was on, and
    # the next request without LoRAs skipped disable_lora() and ran with the LoRA on.
    model = model_with(loras)
    plain = sd.reference(sd.sd_pipe(), RAW)[0]
    assert torch.equal(sd.run(model, RAW)[-1], plain)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("set_adapters failed")

    monkeypatch.setattr(model._pipe, "set_adapters", broken)
    with pytest.raises(RuntimeError, match="set_adapters failed"):
        sd.run(model, dict(RAW, loras=[{"name": "ink", "scale": 1.0}]))
    monkeypatch.undo()
    assert torch.equal(sd.run(model, RAW)[-1], plain)


def test_a_default_seed_of_minus_one_stays_random() -> None:
    # defaults={"seed": -1} once drew one seed at construction and gave it to every request.
    model = Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings, defaults={"seed": -1, "steps": 3})
    seeds = {model.validate({})["seed"] for _ in range(4)}
    assert len(seeds) > 1 and next(p for p in model.params if p.name == "seed").default == -1
    fixed = Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings, defaults={"seed": 7})
    assert fixed.validate({})["seed"] == 7
