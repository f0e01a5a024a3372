"""A1111's infotext: written complete (LoRAs, hashes), read back as A1111 reads it, round trips."""

from __future__ import annotations

from omni_stream.models.mixture import Mixture
from omni_stream.preview.infotext import lora_tags, parameters_text, params_from_infotext, parse_infotext

# A request as a diffusers model checks it, with what the CLI and server add (model, output, hashes).
CHECKED = {
    "prompt": "a harbour, at dawn",
    "negative_prompt": "blurry",
    "steps": 20,
    "guidance_scale": 7.5,
    "guidance_rescale": 0.0,
    "sampler": "dpmpp_2m_karras",
    "eta": 0.0,
    "seed": 42,
    "height": 768,
    "width": 512,
    "num_images": 1,
    "loras": (("ink", 0.8), ("pastel", 1.0)),
}
META = {
    **CHECKED,
    "model": "sd:v1",
    "output": "image",
    "hashes": {"model": "6ce0161689", "loras": {"ink": "1f3a6c0b2d4e", "pastel": "aa00bb11cc22"}},
}
TEXT = (
    "a harbour, at dawn <lora:ink:0.8> <lora:pastel:1>\n"
    "Negative prompt: blurry\n"
    "Steps: 20, Sampler: dpmpp_2m_karras, CFG scale: 7.5, Seed: 42, Size: 512x768, Model hash: 6ce0161689, "
    'Model: "sd:v1", guidance_rescale: 0.0, eta: 0.0, num_images: 1, '
    'Lora hashes: "ink: 1f3a6c0b2d4e, pastel: aa00bb11cc22"'
)


def test_the_text_names_the_loras_with_their_weights_and_the_hashes_as_a1111_does():
    assert parameters_text(META, width=512, height=768) == TEXT
    # A LoRA without a known hash is still in the prompt; "Lora hashes" lists those known.
    partial = {**META, "hashes": {"loras": {"pastel": "aa00bb11cc22"}}}
    text = parameters_text(partial, width=512, height=768)
    assert "<lora:ink:0.8>" in text and 'Lora hashes: "pastel: aa00bb11cc22"' in text
    assert "Model hash" not in text


def test_parse_reads_a1111s_keys():
    assert parse_infotext(TEXT) == {
        "Prompt": "a harbour, at dawn <lora:ink:0.8> <lora:pastel:1>",
        "Negative prompt": "blurry",
        "Steps": "20",
        "Sampler": "dpmpp_2m_karras",
        "CFG scale": "7.5",
        "Seed": "42",
        "Size-1": "512",
        "Size-2": "768",
        "Model hash": "6ce0161689",
        "Model": "sd:v1",
        "guidance_rescale": "0.0",
        "eta": "0.0",
        "num_images": "1",
        "Lora hashes": "ink: 1f3a6c0b2d4e, pastel: aa00bb11cc22",
    }


def test_parse_reads_what_a1111_writes():
    text = (
        "masterpiece, a cat <lora:add_detail:0.6>\nwith a hat\n"
        "Negative prompt: lowres,\nbad hands\n"
        "Steps: 28, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 6, Seed: 1234, Size: 832x1216, "
        "Model hash: 31e35c80fc, Model: sd_xl_base_1.0, Denoising strength: 0.35, "
        'Lora hashes: "add_detail: 7c6bad76eb54", '
        "Version: v1.10.1"
    )
    fields = parse_infotext(text)
    assert fields["Prompt"] == "masterpiece, a cat <lora:add_detail:0.6>\nwith a hat"
    assert fields["Negative prompt"] == "lowres,\nbad hands"
    assert (fields["Size-1"], fields["Size-2"], fields["Version"]) == ("832", "1216", "v1.10.1")
    assert params_from_infotext(text) == {
        "prompt": "masterpiece, a cat <lora:add_detail:0.6>\nwith a hat",
        "negative_prompt": "lowres,\nbad hands",
        "steps": 28,
        "sampler": "DPM++ 2M Karras",
        "guidance_scale": 6.0,
        "seed": 1234,
        "strength": 0.35,
        "width": 832,
        "height": 1216,
    }
    # A last line of fewer than three pairs is prompt (A1111's rule).
    assert parse_infotext("a cat\nSteps: 3") == {"Prompt": "a cat\nSteps: 3", "Negative prompt": ""}


def test_write_then_read_gives_the_params_back():
    read = params_from_infotext(parameters_text(META, width=512, height=768))
    assert read == {
        **{k: v for k, v in CHECKED.items() if k != "loras"},
        "prompt": "a harbour, at dawn <lora:ink:0.8> <lora:pastel:1>",
    }
    # A model whose params A1111 names by other names (guidance as CFG scale, size as Size).
    mixture = Mixture()
    checked = mixture.validate(
        {
            "prompt": "red circle",
            "steps": 12,
            "size": 96,
            "seed": 3,
            "guidance": 2.5,
            "sampler": "euler_a",
            "spread": 0.1,
        }
    )
    text = parameters_text({**checked, "model": "mixture"}, width=96, height=96)
    assert "CFG scale: 2.5" in text and "Size: 96x96" in text
    assert mixture.validate(params_from_infotext(text)) == checked


def test_values_that_would_end_a_pair_are_quoted_and_read_back():
    params = {"prompt": "x", "steps": 2, "seed": 1, "style": 'a, b: "c"\nd', "flag": True, "ratio": 1e-05}
    text = parameters_text(params, width=8, height=8)
    assert 'style: "a, b: \\"c\\"\\nd"' in text and "flag: true" in text
    read = params_from_infotext(text)
    assert (read["style"], read["flag"], read["ratio"]) == ('a, b: "c"\nd', True, 1e-05)


def test_lora_tags_write_a_weight_that_reads_back_as_the_same_float():
    assert lora_tags((("a", 1.0), ("b", 0.1 + 0.2))) == "<lora:a:1> <lora:b:0.30000000000000004>"
    assert lora_tags([{"name": "a"}, {"name": "b", "scale": -0.5}, "junk"]) == "<lora:a:1> <lora:b:-0.5>"
    assert (
        parameters_text({"loras": [{"name": "a", "scale": 2}]}, width=1, height=1) == "<lora:a:2>\nSize: 1x1"
    )
