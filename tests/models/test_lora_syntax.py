"""``<lora:NAME:WEIGHT>`` in a prompt: A1111's syntax, read as the ``loras`` param.

The tiny UNet and its random LoRAs are test_diffusers_loras.py's; a prompt's
embeddings are test_diffusers.py's fixed ones, so a prompt that differs by a
byte would give other latents.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from omni_stream import ParamsError  # noqa: E402
from omni_stream.models.diffusers import Diffusers  # noqa: E402
from omni_stream.models.diffusers.loras import check_request_loras, prompt_loras  # noqa: E402
from omni_stream.preview.infotext import parameters_text, params_from_infotext  # noqa: E402

from . import test_diffusers as sd  # noqa: E402
from .test_diffusers_loras import make_lora  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

RAW = dict(negative_prompt="blur", steps=3, seed=5, height=16, width=16)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("loras")
    model = Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings)
    model.load_loras({"ink": make_lora(root / "ink", 7), "pastel": make_lora(root / "pastel", 8)})
    return model


def test_a_prompt_tag_equals_the_loras_param(model: Any) -> None:
    tagged = dict(RAW, prompt="a cat <lora:ink:0.8>")
    named = dict(RAW, prompt="a cat", loras=[{"name": "ink", "scale": 0.8}])
    checked = model.validate(tagged)
    assert checked["prompt"] == "a cat" and checked["loras"] == (("ink", 0.8),)
    assert checked == model.validate(named)
    frames = sd.run(model, tagged)
    assert torch.equal(frames[-1], sd.run(model, named)[-1])
    # The LoRA did something: without it, other latents.
    assert not torch.equal(frames[-1], sd.run(model, dict(RAW, prompt="a cat"))[-1])


def test_tags_merge_with_the_param_and_a_name_twice_is_refused(model: Any) -> None:
    checked = model.validate(dict(RAW, prompt="<lora:pastel> a cat", loras=[{"name": "ink", "scale": 0.5}]))
    assert checked["prompt"] == "a cat" and checked["loras"] == (("ink", 0.5), ("pastel", 1.0))
    for prompt, loras, words in [
        ("a cat <lora:ink:0.8>", [{"name": "ink"}], "names 'ink', which the request names already"),
        ("<lora:ink:1> <lora:ink:0.5>", None, "name each LoRA once"),
        ("a cat <lora:nope:1>", None, "'nope', which is not a loaded LoRA; known: ink, pastel"),
        ("a cat <lora:ink:9>", None, "weight must be from -4 to 4"),
        ("a cat <lora:ink:x>", None, "weight 'x' is not a number"),
        ("a cat <lora:ink:0.5:0.7>", None, "other weights"),
        ("a cat <lora:ink:te=0.5>", None, "named weights"),
        ("a cat <lora::1>", None, "names no LoRA"),
    ]:
        with pytest.raises(ParamsError) as err:
            model.validate(dict(RAW, prompt=prompt, loras=loras))
        assert err.value.field == "prompt" and words in err.value.message, (prompt, err.value.message)


def test_a1111s_spellings_of_a_tag() -> None:
    assert prompt_loras("a cat") == ("a cat", [])
    # The weight 1 when left out; two equal weights (text encoders, UNet) are one.
    # Each tag leaves with the whitespace before it; the rest is stripped.
    text, tags = prompt_loras(" <lora:ink>, a cat,<lora:my style:0.5:0.5> in snow <lora:pastel:-1>")
    assert text == ", a cat, in snow"
    assert [(n, s) for n, s, _ in tags] == [("ink", 1.0), ("my style", 0.5), ("pastel", -1.0)]
    # The negative prompt is left as it is (A1111 reads tags in the prompt only).
    assert check_request_loras(None, None, ["ink"], model="m") == (None, ())


def test_the_pngs_infotext_gives_back_params_that_reproduce_the_picture(model: Any) -> None:
    raw = dict(RAW, prompt="a cat <lora:ink:0.8>", loras=[{"name": "pastel", "scale": 0.25}])
    params = {**model.validate(raw), "model": "sd", "output": "image"}
    text = parameters_text({**params, "hashes": model.weight_hashes(params)}, width=16, height=16)
    assert text.splitlines()[0] == "a cat <lora:ink:0.8> <lora:pastel:0.25>"
    hashes = model._loras.hashes
    assert f'Lora hashes: "ink: {hashes["ink"]}, pastel: {hashes["pastel"]}"' in text
    read = params_from_infotext(text)
    assert model.validate(read) == {k: v for k, v in params.items() if k not in ("model", "output")}
    assert torch.equal(sd.run(model, read)[-1], sd.run(model, raw)[-1])
