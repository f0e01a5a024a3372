"""``omni-stream generate`` and ``models`` on a diffusers pipeline saved to a folder (tiny, offline)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from PIL import Image

from omni_stream import cli

pytest.importorskip("diffusers")

from .conftest import one_torch_thread  # noqa: E402
from .models.test_diffusers import text_sd_pipe  # noqa: E402
from .models.test_diffusers_output import tiny_taesd  # noqa: E402

pytestmark = [
    pytest.mark.diffusers,
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]


def _load_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "info: model " in line]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny text-to-image pipeline and a tiny autoencoder, saved as from_pretrained reads them."""
    with one_torch_thread():  # the producer's default: results equal pipe()'s bit for bit
        root = tmp_path_factory.mktemp("pipes")
        pipe = text_sd_pipe(root)
        pipe.save_pretrained(root / "sd")
        tiny_taesd().save_pretrained(root / "taesd")
        yield root, pipe


def test_generate_writes_the_pipelines_image_at_full_size(saved, capsys, tmp_path):
    root, pipe = saved
    out, previews = tmp_path / "cat.png", tmp_path / "steps.gif"
    code = cli.main([
        "generate", "a red cat", "--model", f"diffusers:{root / 'sd'}", "--size", "32",
        "--steps", "3", "--seed", "4", "-o", str(out), "--previews", str(previews),
        "--preview-vae", str(root / "taesd"),
    ])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert "cat.png (32x32)" in err and "2 previews" in err
    # The mode the pipeline runs in, said once at INFO while the model loads.
    assert _load_lines(err) == [f"omni-stream: info: model diffusers:{root / 'sd'}: "
                                "StableDiffusionPipeline, native mode"]
    image = Image.open(out)
    expected = pipe(prompt="a red cat", num_inference_steps=3, height=32, width=32,
                    generator=torch.Generator().manual_seed(4), output_type="pil").images[0]
    assert image.size == (32, 32)
    assert image.convert("RGB").tobytes() == expected.tobytes()
    made = json.loads(image.text["omni_stream"])
    assert (made["prompt"], made["steps"], made["seed"], made["height"]) == ("a red cat", 3, 4, 32)
    assert image.text["parameters"].startswith("a red cat\nSteps: 3")
    # The two steps before the result, decoded by the tiny autoencoder at full size.
    gif = Image.open(previews)
    assert gif.n_frames == 2 and gif.size == (32, 32)


def test_generate_num_images_writes_one_file_per_image(saved, capsys, tmp_path):
    # Issue #20: --num-images N is num_images_per_prompt; out.png becomes out-0.png ... out-{N-1}.png,
    # and the previews (here decoded by the tiny autoencoder) are grids of the N images.
    root, pipe = saved
    out, previews = tmp_path / "cat.png", tmp_path / "steps"
    code = cli.main([
        "generate", "a red cat", "--model", f"diffusers:{root / 'sd'}", "--size", "32", "--steps", "2",
        "--seed", "4", "--num-images", "5", "-o", str(out), "--previews", str(previews),
        "--preview-vae", str(root / "taesd"),
    ])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert "cat-0.png ... cat-4.png (32x32, 5 images)" in err, err
    assert not out.exists()
    expected = pipe(prompt="a red cat", num_inference_steps=2, height=32, width=32, num_images_per_prompt=5,
                    generator=torch.Generator().manual_seed(4), output_type="pil").images
    for i, image in enumerate(expected):
        got = Image.open(tmp_path / f"cat-{i}.png")
        assert got.convert("RGB").tobytes() == image.tobytes()
        assert json.loads(got.text["omni_stream"])["num_images"] == 5
    (grid,) = sorted(previews.iterdir())
    assert Image.open(grid).size == (96, 64)  # 5 images of 32 px: 3 columns, 2 rows


def test_generate_takes_a_sampler_by_its_a1111_name(saved, capsys, tmp_path):
    # The issue: `generate ... --sampler euler_a` answered "takes no 'sampler' param".
    import copy

    from diffusers import EulerAncestralDiscreteScheduler

    root, _ = saved
    out = tmp_path / "cat.png"
    code = cli.main([
        "generate", "a red cat", "--model", f"diffusers:{root / 'sd'}", "--size", "32",
        "--steps", "3", "--seed", "4", "--sampler", "euler_a", "-o", str(out),
    ])
    _, err = capsys.readouterr()
    assert code == 0, err
    # The reference is the pipeline as the CLI loads it: a config read from disk carries no
    # `_use_default_values`, so from_config keeps every saved value (timestep_spacing too).
    from diffusers import StableDiffusionPipeline

    loaded = StableDiffusionPipeline.from_pretrained(root / "sd")
    loaded.set_progress_bar_config(disable=True)
    switched = copy.copy(loaded)
    switched.scheduler = EulerAncestralDiscreteScheduler.from_config(loaded.scheduler.config)
    with one_torch_thread():
        expected = switched(prompt="a red cat", num_inference_steps=3, height=32, width=32,
                            generator=torch.Generator().manual_seed(4), output_type="pil").images[0]
    assert Image.open(out).convert("RGB").tobytes() == expected.tobytes()
    assert "Sampler: euler_a" in Image.open(out).text["parameters"]
    code = cli.main(["generate", "x", "--model", f"diffusers:{root / 'sd'}", "--sampler", "dpm_fast",
                     "-o", str(tmp_path / "no.png")])
    _, err = capsys.readouterr()
    assert code == 2 and "'sampler'" in err and "dpmpp_2m_karras" in err, err


def test_generate_loads_a_lora_that_the_request_names(saved, capsys, tmp_path):
    pytest.importorskip("peft")
    from .models.test_diffusers_loras import make_lora

    root, _ = saved
    lora = make_lora(tmp_path / "ink", 7)
    out = tmp_path / "ink.png"
    code = cli.main([
        "generate", "a red cat", "--model", f"diffusers:{root / 'sd'}", "--size", "32", "--steps", "2",
        "--seed", "4", "--lora", f"ink={lora}", "-p", 'loras=[{"name": "ink", "scale": 0.5}]', "-o", str(out),
    ])
    _, err = capsys.readouterr()
    assert code == 0, err
    from diffusers import StableDiffusionPipeline

    loaded = StableDiffusionPipeline.from_pretrained(root / "sd")
    loaded.set_progress_bar_config(disable=True)
    loaded.load_lora_weights(str(lora), adapter_name="ink")
    loaded.set_adapters(["ink"], adapter_weights=[0.5])
    with one_torch_thread():
        expected = loaded(prompt="a red cat", num_inference_steps=2, height=32, width=32,
                          generator=torch.Generator().manual_seed(4), output_type="pil").images[0]
    assert Image.open(out).convert("RGB").tobytes() == expected.tobytes()
    # A LoRA the request names but the command did not load; a built-in model with --lora.
    code = cli.main(["generate", "x", "--model", f"diffusers:{root / 'sd'}", "-p", 'loras=[{"name": "ink"}]',
                     "-o", str(tmp_path / "no.png")])
    _, err = capsys.readouterr()
    assert code == 2 and "serve --lora NAME=PATH" in err, err
    code = cli.main(["generate", "x", "--lora", f"ink={lora}", "-o", str(tmp_path / "no.png")])
    _, err = capsys.readouterr()
    assert code == 2 and "takes no LoRAs" in err, err


def test_models_names_the_pipeline_and_its_mode(saved, capsys):
    root, _ = saved
    code = cli.main(["models", f"diffusers:{root / 'sd'}", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    (row,) = json.loads(out)
    assert row["description"] == "StableDiffusionPipeline, native mode"
    assert {"prompt", "steps", "height", "width", "seed", "sampler"} <= {p["name"] for p in row["params"]}
    (sampler,) = [p for p in row["params"] if p["name"] == "sampler"]
    assert {"default", "euler", "euler_a", "dpmpp_2m_karras", "ddim", "unipc"} <= set(sampler["choices"])


def test_generate_in_callback_mode_takes_size_and_output_latent(saved, capsys, tmp_path, monkeypatch):
    root, pipe = saved
    # A module:attr factory, the way a user serves a pipeline in callback mode.
    (tmp_path / "cbfactory.py").write_text(
        "from diffusers import StableDiffusionPipeline\n"
        "from omni_stream.models.diffusers import Diffusers\n"
        f"def make():\n    return Diffusers(StableDiffusionPipeline.from_pretrained({str(root / 'sd')!r}), mode='callback')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "cb.png"
    code = cli.main(["generate", "a red cat", "--model", "cbfactory:make", "--size", "32", "--steps", "2",
                     "--seed", "4", "-o", str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert _load_lines(err) == ["omni-stream: info: model cbfactory:make: StableDiffusionPipeline, callback mode"]
    expected = pipe(prompt="a red cat", num_inference_steps=2, height=32, width=32,
                    generator=torch.Generator().manual_seed(4), output_type="pil").images[0]
    assert Image.open(out).convert("RGB").tobytes() == expected.tobytes()
    # The final latent instead, drawn by the preview decoder (one pixel a latent pixel).
    code = cli.main(["generate", "a red cat", "--model", "cbfactory:make", "--size", "32", "--steps", "2",
                     "-p", "output=latent", "-o", str(tmp_path / "latent.png")])
    _, err = capsys.readouterr()
    assert code == 0, err
    latent = Image.open(tmp_path / "latent.png")
    assert latent.size == (16, 16) and json.loads(latent.text["omni_stream"])["output"] == "latent"


def test_serve_says_which_mode_the_pipeline_runs_in_before_it_listens(saved, capsys, monkeypatch):
    root, _ = saved
    module = types.ModuleType("omni_stream.server")
    seen: list[str] = []

    async def serve(**kwargs):
        seen.append((kwargs["model"].mode, kwargs["model"].max_batch_size))

    module.serve = serve  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "omni_stream.server", module)
    code = cli.main(["serve", "--model", f"diffusers:{root / 'sd'}"])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert seen == [("native", 8)]  # batching across requests: on by default
    assert cli.main(["serve", "--model", f"diffusers:{root / 'sd'}", "--no-batch"]) == 0
    assert seen[-1] == ("native", 1)
    capsys.readouterr()
    assert _load_lines(err) == [f"omni-stream: info: model diffusers:{root / 'sd'}: "
                                "StableDiffusionPipeline, native mode"]
