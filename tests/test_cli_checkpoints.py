"""A1111 and ComfyUI folders on the command line: single-file checkpoints, --model-dir, LoRAs per model.

The checkpoint is the tiny SD pipeline of tests/models/test_single_file.py,
written in the original (LDM) layout; its saved folder is the config.
"""

from __future__ import annotations

import shutil
import sys
import types

import pytest
from PIL import Image

from omni_stream import cli

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from .models.test_diffusers import text_sd_pipe  # noqa: E402
from .models.test_diffusers_loras import make_lora  # noqa: E402
from .models.test_single_file import _header_only, write_single_file  # noqa: E402

pytestmark = [
    pytest.mark.diffusers,
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The config folder, the checkpoint, a LoRA."""
    root = tmp_path_factory.mktemp("a1111")
    pipe = text_sd_pipe(root)
    pipe.save_pretrained(root / "sd")
    return root / "sd", write_single_file(pipe, root / "tiny.safetensors"), make_lora(root / "ink", 7)


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error:" in line]


def test_generate_from_a_checkpoint_file_equals_its_folder_and_the_png_names_hashes_and_loras(
    files, capsys, tmp_path
):
    folder, file, lora = files
    common = ["--size", "16", "--steps", "2", "--seed", "4", "--lora", f"ink={lora}"]
    outs = {}
    for spelling in (
        [str(file), "--model-config", f"v1={folder}"],
        [f"{file}?config={folder}"],
        [f"diffusers:{folder}"],
    ):
        out = tmp_path / f"{len(outs)}.png"
        code = cli.main(
            ["generate", "a red cat <lora:ink:0.5>", "--model", *spelling, *common, "-o", str(out)]
        )
        _, err = capsys.readouterr()
        assert code == 0, err
        outs[spelling[0]] = Image.open(out)
    single, query, saved = outs.values()
    assert single.convert("RGB").tobytes() == query.convert("RGB").tobytes() == saved.convert("RGB").tobytes()
    text = single.text["parameters"]
    import hashlib

    assert text.startswith("a red cat <lora:ink:0.5>\n")
    assert f"Model hash: {hashlib.sha256(file.read_bytes()).hexdigest()[:10]}" in text
    assert 'Lora hashes: "ink: ' in text and "Model hash" not in saved.text["parameters"]


def test_pickles_and_bound_loras_on_generate_are_refused(files, capsys, tmp_path):
    folder, _, lora = files
    (tmp_path / "old.ckpt").write_bytes(b"")
    for argv, words in [
        (["--model", str(tmp_path / "old.ckpt")], "Python pickle"),
        (["--model", f"diffusers:{folder}", "--lora", f"sd:ink={lora}"], "generate runs one model"),
        (["--model", str(tmp_path / "old.ckpt"), "--model-config", f"v1={tmp_path}"], "no model_index.json"),
    ]:
        code = cli.main(["generate", "x", *argv, "-o", str(tmp_path / "no.png")])
        _, err = capsys.readouterr()
        assert code == 2 and len(_errors(err)) == 1 and words in err, (argv, err)


@pytest.fixture
def served(monkeypatch):
    calls: list[dict] = []
    module = types.ModuleType("omni_stream.server")

    async def serve(**kwargs):
        calls.append(kwargs)

    module.serve = serve  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "omni_stream.server", module)
    return calls


def test_serve_a_checkpoint_folder_with_loras_bound_per_model(files, capsys, served, tmp_path):
    folder, file, lora = files
    models = tmp_path / "Stable-diffusion"
    models.mkdir()
    for name in ("a.safetensors", "b.safetensors", "bad name.safetensors"):
        shutil.copy(file, models / name)
    (models / "old.ckpt").write_bytes(b"")
    _header_only(
        models / "inpaint.safetensors", {"model.diffusion_model.input_blocks.0.0.weight": (4, 9, 1, 1)}
    )
    (models / "notes.txt").write_text("not a model")
    shared = tmp_path / "Lora"
    make_lora(shared / "pastel", 8)
    code = cli.main(
        [
            "serve",
            "--model",
            "mix=mixture",
            "--model-dir",
            str(models),
            "--model-config",
            str(folder),
            "--lora",
            f"a:ink={lora}",
            "--lora-dir",
            str(shared),
            "--max-loaded",
            "1",
        ]
    )
    _, err = capsys.readouterr()
    assert code == 0, err
    router = served[-1]["model"]
    assert list(router.models) == ["mix", "a", "b"]
    # Every model that takes LoRAs gets the shared ones; mixture, beside them, is passed over.
    assert router.models["a"].lora_names == ("pastel", "ink") and router.models["b"].lora_names == ("pastel",)
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 3, err
    assert "bad name.safetensors not served" in warnings[0] and "--model NAME=" in warnings[0]
    assert "inpaint.safetensors" in warnings[1] and "'inpainting'" in warnings[1]
    assert "old.ckpt" in warnings[2] and "Python pickle" in warnings[2]
    for argv, words in [
        (["--lora", f"mix:ink={lora}"], "model 'mixture' takes no LoRAs (ink)"),
        (["--lora", f"c:ink={lora}"], "no model is named 'c'; served: mix, a, b"),
        (["--lora-dir", f"a={shared}", "--lora", f"a:pastel={lora}"], "given twice for model 'a'"),
        (["--model", "a=synthetic"], "would be model 'a', which is named already"),
    ]:
        code = cli.main(
            [
                "serve",
                "--model",
                "mix=mixture",
                "--model-dir",
                str(models),
                "--model-config",
                str(folder),
                *argv,
            ]
        )
        _, err = capsys.readouterr()
        assert code == 2 and len(_errors(err)) == 1 and words in err, (argv, err)
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv, words in [
        (["--model-dir", str(empty)], "holds no checkpoint that loads"),
        (["--model-config", f"nope={folder}"], "TYPE one of v1, v2"),
        (["--model", "synthetic", "--lora", f"ink={lora}"], "takes no LoRAs"),
    ]:
        code = cli.main(["serve", *argv])
        _, err = capsys.readouterr()
        assert code == 2 and words in err, (argv, err)
