"""The AUTOMATIC1111 door (issue #37): webuiapi, the A1111 client on PyPI, unmodified, against a
real ``omni-stream serve`` in its own process (one for the module: three tiny models, a LoRA,
two tenants whose passwords are their tokens).

Each picture is compared with the diffusers pipeline's own, made here; the door's checks (token,
Origin, Host, body bound, the fair share) are the other doors' red-team checks, on these routes.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from ..conftest import one_torch_thread

webuiapi = pytest.importorskip("webuiapi")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from diffusers import (  # noqa: E402
    DPMSolverMultistepScheduler,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
)

from omni_stream.a1111.inpaint_area import inpainting, overlaid  # noqa: E402
from omni_stream.a1111.masks import blurred  # noqa: E402
from omni_stream.models.diffusers.samplers import SCHEDULES  # noqa: E402
from omni_stream.preview.infotext import parse_infotext  # noqa: E402

from ..models import test_diffusers as sd  # noqa: E402
from ..models import test_diffusers_callback as cb  # noqa: E402
from ..models.test_diffusers_control import mask as half_mask  # noqa: E402
from ..models.test_diffusers_loras import make_lora  # noqa: E402
from .test_serve import omni_stream_serve  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

TOKENS = {"alice": "alice-s3cret", "bob": "bob-s3cret"}
#: The served bound on a body (OMNI_STREAM_MAX_MESSAGE_BYTES): a tiny img2img fits.
BODY_BOUND = 64 * 1024
#: A request that runs until it is stopped (900 steps of a few ms each here).
LONG = dict(prompt="a slow cat", steps=900, width=16, height=16, seed=1, sampler_name="DDIM")


@dataclass
class Served:
    url: str
    pipes: dict[str, Any]

    def client(self, name: str) -> Any:
        """webuiapi as its users make it: the server's A1111 base URL, basic auth."""
        return webuiapi.WebUIApi(baseurl=self.url + "/sdapi/v1", username=name, password=TOKENS[name])


def pipes(root: Path) -> dict[str, Any]:
    """Three tiny pipelines sharing a text encoder: ``a``, ``b`` (its UNet's output flipped: other
    pictures) and an inpaint pipeline."""
    a = sd.text_sd_pipe(root)
    unet = copy.deepcopy(a.unet)
    with torch.no_grad():
        unet.conv_out.weight.neg_()
    parts = dict(vae=a.vae, text_encoder=a.text_encoder, tokenizer=a.tokenizer, scheduler=a.scheduler,
                 safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    made = {"a": a, "b": StableDiffusionPipeline(unet=unet, **parts),
            "inpaint": StableDiffusionInpaintPipeline(unet=a.unet, **parts)}
    for pipe in made.values():
        pipe.set_progress_bar_config(disable=True)
    return made


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("a1111")
    with one_torch_thread():
        made = pipes(root)
        for name, pipe in made.items():
            pipe.save_pretrained(root / name)
        lora = make_lora(root / "ink", 7)
    args = [arg for name in made for arg in ("--model", f"{name}=diffusers:{root / name}")]
    args += [arg for name, secret in TOKENS.items() for arg in ("--token", f"{name}={secret}")]
    env = {"OMNI_STREAM_MAX_MESSAGE_BYTES": str(BODY_BOUND), "OMNI_STREAM_MAX_REQUESTS_PER_PRINCIPAL": "1"}
    with omni_stream_serve(*args, "--lora", f"ink={lora}", "--device", "cpu", env=env) as (_, _, url):
        yield Served(url, made)


def reference(pipe: Any, *, seed: int, n: int = 1, scheduler: Any = None, **kwargs: Any) -> list[bytes]:
    """The pipeline's own pictures (RGB bytes) for a request's params."""
    if scheduler is not None:
        pipe = type(pipe)(**{**pipe.components, "scheduler": scheduler})
    with one_torch_thread():
        images = pipe(generator=torch.Generator().manual_seed(seed), num_images_per_prompt=n, output_type="pil",
                      **kwargs).images
    return [image.convert("RGB").tobytes() for image in images]


def rgb(image: Image.Image) -> bytes:
    return image.convert("RGB").tobytes()


def wait_until(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """Poll ``check`` until it returns something true; a generous bound only against hanging."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.02)
    return found


def infotext_seed(text: str) -> str:
    """The ``Seed`` an infotext says."""
    return str(parse_infotext(text)["Seed"])


def refusal(call: Callable[[], Any]) -> tuple[int, dict[str, Any]]:
    """webuiapi's RuntimeError(status, body) for a refused call, the body parsed."""
    with pytest.raises(RuntimeError) as info:
        call()
    status, text = info.value.args
    return status, json.loads(text)


def test_txt2img_with_a_sampler_and_scheduler_equals_the_pipeline(served: Served) -> None:
    alice = served.client("alice")
    made = alice.txt2img(prompt="a red cat", negative_prompt="dog", steps=2, seed=3, cfg_scale=6.0, width=24,
                         height=16, sampler_name="DPM++ 2M", scheduler="Karras", batch_size=2, n_iter=2)
    pipe = served.pipes["a"]
    karras = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config, algorithm_type="dpmsolver++",
                                                     solver_order=2, use_karras_sigmas=True)
    same = dict(prompt="a red cat", negative_prompt="dog", num_inference_steps=2, guidance_scale=6.0, width=24,
                height=16, scheduler=karras)
    # n_iter 2 of batch_size 2: image j of iteration i of seed 3 + 2i + j, each of its own noise, as A1111's.
    assert [rgb(i) for i in made.images] == [image for seed in (3, 4, 5, 6) for image in reference(pipe, seed=seed,
                                                                                                   **same)]
    info = made.info
    assert (info["seed"], info["all_seeds"], info["sd_model_name"]) == (3, [3, 4, 5, 6], "a")
    assert info["sampler_name"] == "DPM++ 2M" and info["extra_generation_params"] == {"Schedule type": "Karras"}
    assert [i.info["parameters"] for i in made.images] == info["infotexts"]
    assert [infotext_seed(text) for text in info["infotexts"]] == ["3", "4", "5", "6"]  # each image's own
    assert "Sampler: dpmpp_2m_karras" in info["infotexts"][0] and made.parameters["scheduler"] == "Karras"


def test_one_image_of_a_batch_is_made_again_from_its_seed_alone(served: Served) -> None:
    alice = served.client("alice")
    params = dict(prompt="a green owl", steps=2, width=16, height=16, sampler_name="Euler a")
    batch = alice.txt2img(seed=-1, batch_size=3, **params)
    first = batch.info["seed"]
    assert first != -1 and batch.info["all_seeds"] == [first, first + 1, first + 2]  # -1 draws one, then + k
    assert [infotext_seed(i.info["parameters"]) for i in batch.images] == [str(first + k) for k in range(3)]
    again = alice.txt2img(seed=first + 2, batch_size=1, **params)
    assert rgb(again.image) == rgb(batch.images[2]) != rgb(batch.images[1])  # bit for bit


def test_png_info_of_a_random_seed_picture_makes_it_again(served: Served) -> None:
    alice = served.client("alice")
    first = alice.txt2img(prompt="a blue fox", steps=2, seed=-1, width=16, height=16, sampler_name="Euler a")
    seed = first.info["seed"]
    assert seed != -1 and first.info["all_seeds"] == [seed]
    read = alice.png_info(first.image)
    assert read.info == first.info["infotexts"][0]
    fields = read.json["parameters"]
    assert (fields["Seed"], fields["Sampler"], fields["Size-1"], fields["Model"]) == (str(seed), "Euler a", "16", "a")
    again = served.client("bob").txt2img(**read.json["request"])  # another tenant, the same picture
    assert rgb(again.image) == rgb(first.image) and again.info["seed"] == seed


def test_util_set_model_chooses_the_model_of_that_tenants_requests_only(served: Served) -> None:
    alice, bob = served.client("alice"), served.client("bob")
    params = dict(prompt="a cat", steps=2, seed=4, width=16, height=16, sampler_name="DDIM")
    assert sorted(alice.util_get_model_names()) == ["a", "b", "inpaint"]
    alice.util_set_model("b")
    try:
        assert (alice.util_get_current_model(), bob.util_get_current_model()) == ("b", "a")
        from_b, from_a = alice.txt2img(**params), bob.txt2img(**params)
    finally:
        alice.util_set_model("a")
    same = dict(prompt="a cat", num_inference_steps=2, width=16, height=16, guidance_scale=7.0)
    assert [rgb(from_b.image)] == reference(served.pipes["b"], seed=4, **same)
    assert [rgb(from_a.image)] == reference(served.pipes["a"], seed=4, **same) != [rgb(from_b.image)]
    assert (from_b.info["sd_model_name"], from_a.info["sd_model_name"]) == ("b", "a")
    # (webuiapi's set_options reads any answer as JSON: its own session says the status.)
    unknown = alice.session.post(alice.baseurl + "/options", json={"sd_model_checkpoint": "sd3"})
    assert (unknown.status_code, unknown.json()["field"]) == (404, "sd_model_checkpoint")


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def test_img2img_with_a_mask_equals_the_inpaint_pipeline_under_a1111s_overlay(served: Served) -> None:
    """The inpaint pipeline's picture of the images A1111 would sample (a1111/inpaint_area.py), under
    A1111's overlay: the pixels outside the mask are the ones sent."""
    alice = served.client("alice")
    pipe = served.pipes["inpaint"]
    params = dict(prompt="a red cat", negative_prompt="dog", steps=3, seed=3, cfg_scale=6.0, width=16, height=16)
    same = dict(prompt="a red cat", negative_prompt="dog", num_inference_steps=3, strength=1.0, guidance_scale=6.0,
                width=16, height=16)

    def expected(made: Any, picture: Image.Image, mask: Image.Image, **area: Any) -> bytes:
        prepared = inpainting(png_bytes(picture), png_bytes(mask), size=(16, 16), **area)
        image, soft = (Image.open(io.BytesIO(data)) if data else sent
                       for data, sent in ((prepared.image, picture), (prepared.mask, mask)))
        [result] = reference(pipe, seed=3, image=image, mask_image=soft, **same)
        assert prepared.overlay is not None
        under = overlaid(png_bytes(Image.frombytes("RGB", (16, 16), result)), prepared.overlay)
        return rgb(Image.open(io.BytesIO(under)))

    # The whole picture: webuiapi sends A1111's mask_blur 4, the pipeline is given the mask blurred as
    # A1111 blurs it, and the answer is its picture under the overlay.
    picture, mask = cb.picture(16, 16), half_mask(16, 16)
    whole = alice.img2img(images=[picture], mask_image=mask, denoising_strength=1.0, sampler_name="DDIM",
                          override_settings={"sd_model_checkpoint": "inpaint"}, inpaint_full_res=False,
                          inpainting_fill=1, **params)
    assert rgb(whole.image) == expected(whole, picture, mask, blur_x=4, blur_y=4, full_res=False, padding=0,
                                        fill_mode=1)
    assert whole.info["denoising_strength"] == 1.0 and whole.info["sd_model_name"] == "inpaint"
    assert whole.info["extra_generation_params"] == {"Schedule type": "Automatic", "Mask blur": 4}
    assert whole.image.info["parameters"] == whole.info["infotexts"][0]  # the infotext kept
    # "Only masked" (webuiapi's default, A1111's API's) and A1111's fill (its default too): a box of a
    # 32 x 32 picture, cropped with 2 pixels around it, repainted at 16 x 16, pasted back.
    picture = cb.picture(32, 32, seed=1)
    box = Image.new("L", (32, 32))
    box.paste(255, (20, 4, 28, 12))
    only = alice.img2img(images=[picture], mask_image=box, denoising_strength=1.0, sampler_name="DDIM",
                         override_settings={"sd_model_checkpoint": "inpaint"}, mask_blur=0,
                         inpaint_full_res_padding=2, **params)
    assert only.image.size == (32, 32)
    assert rgb(only.image) == expected(only, picture, box, blur_x=0, blur_y=0, full_res=True, padding=2, fill_mode=0)
    kept = np.asarray(box) == 0
    assert (np.asarray(only.image.convert("RGB"))[kept] == np.asarray(picture)[kept]).all()  # byte for byte
    assert only.info["extra_generation_params"] == {"Schedule type": "Automatic", "Inpaint area": "Only masked",
                                                    "Masked area padding": 2, "Masked content": "fill"}
    assert parse_infotext(only.image.info["parameters"])["Size-1"] == "16"  # what was sampled, as A1111's
    # The caller's model ("a") takes text only: the init image is refused, naming its field.
    status, body = refusal(lambda: alice.img2img(images=[picture], **params))
    assert (status, body["field"], body["code"]) == (422, "init_images", "unsupported")


def test_progress_shows_the_preview_mid_run_skip_goes_on_and_interrupt_stops(served: Served) -> None:
    alice, bob = served.client("alice"), served.client("bob")
    answers: list[Any] = []

    def run() -> None:
        try:
            answers.append(alice.txt2img(n_iter=2, **LONG))
        except Exception as exc:  # noqa: BLE001 - said by the poll below
            answers.append(exc)

    def progress() -> dict[str, Any]:
        assert not any(isinstance(a, Exception) for a in answers), answers
        return alice.get_progress()  # type: ignore[no-any-return]

    call = threading.Thread(target=run, daemon=True)
    call.start()
    try:
        shown = wait_until(lambda: (p := progress())["current_image"] and p, "a live preview")
        state = shown["state"]
        assert (state["job"], state["job_count"], state["job_no"], state["sampling_steps"]) == ("txt2img", 2, 0, 900)
        assert 0 < shown["progress"] < 0.5 and shown["eta_relative"] > 0
        Image.open(io.BytesIO(base64.b64decode(shown["current_image"]))).load()
        # Per tenant: bob sees nothing of alice's, may not stop it, and is not held by it.
        assert bob.get_progress()["state"]["job_count"] == 0
        bob.interrupt()
        assert rgb(bob.txt2img(prompt="a cat", steps=2, width=16, height=16).image)
        status, body = refusal(lambda: alice.txt2img(prompt="a cat", steps=2, width=16, height=16))
        assert (status, body["code"]) == (429, "too_many_requests")  # her one request a time, running
        assert progress()["state"]["job_no"] == 0
        alice.skip()  # the first iteration ends; the second runs
        wait_until(lambda: (p := progress())["state"]["job_no"] == 1 and p["current_image"],
                   "the second iteration's preview")
        alice.interrupt()
        call.join(timeout=60)
    finally:
        alice.interrupt()
    assert not call.is_alive()
    # Neither iteration finished: each answers the picture it had reached (its latest preview, at
    # the image's size), with its infotext, as A1111 answers its half-done images.
    made = answers[0]
    assert made.info["all_seeds"] == [1, 2] and len(made.images) == 2
    assert made.info["infotexts"] == [image.info["parameters"] for image in made.images]
    for image, seed in zip(made.images, (1, 2), strict=True):
        fields = parse_infotext(image.info["parameters"])
        assert image.size == (16, 16) and (fields["Seed"], fields["Steps"], fields["Size-1"]) == (str(seed), "900",
                                                                                                   "16")
        assert (fields["Prompt"], fields["Model"]) == ("a slow cat", "a")
    assert alice.get_progress()["state"]["job_count"] == 0


def test_the_lists_a_client_reads(served: Served) -> None:
    alice = served.client("alice")
    assert alice.get_loras() == [{"name": "ink", "alias": "ink", "path": None, "metadata": {}}]
    samplers = {s["name"]: s for s in alice.get_samplers()}
    assert samplers["DPM++ 2M Karras"] == {"name": "DPM++ 2M Karras", "aliases": ["dpmpp_2m_karras"],
                                           "options": {"scheduler": "karras"}}
    assert samplers["Euler a"]["aliases"] == ["euler_a", "euler_ancestral"]
    assert alice.util_get_scheduler_names() == sorted(SCHEDULES)
    assert [m["title"] for m in alice.get_sd_models()] == ["a", "b", "inpaint"]
    assert alice.get_scripts() == {"txt2img": [], "img2img": []}


def test_the_doors_checks_answer_in_a1111s_shape(served: Served) -> None:
    basic = httpx.BasicAuth("alice", TOKENS["alice"])
    with httpx.Client(base_url=served.url + "/sdapi/v1", timeout=30) as http:

        def shaped(reply: httpx.Response, status: int, code: str) -> dict[str, Any]:
            body = reply.json()
            assert (reply.status_code, body["code"]) == (status, code), body
            assert set(body) == {"error", "detail", "body", "errors", "code", "field"}
            assert body["error"] == "HTTPException" and body["errors"].startswith(f"{status}: ")
            return body

        for method, path in (("POST", "/txt2img"), ("POST", "/img2img"), ("GET", "/progress"), ("GET", "/options"),
                             ("POST", "/interrupt"), ("GET", "/sd-models"), ("POST", "/png-info")):
            assert "basic auth" in shaped(http.request(method, path), 401, "unauthorized")["detail"]
        shaped(http.get("/options", auth=httpx.BasicAuth("alice", "wrong")), 401, "unauthorized")
        assert http.get("/sd-models", headers={"Authorization": f"Bearer {TOKENS['bob']}"}).status_code == 200
        evil = {"Origin": "http://evil.example"}
        shaped(http.post("/txt2img", json={"prompt": "x", "steps": 2}, headers=evil, auth=basic), 403,
               "forbidden_origin")
        shaped(http.get("/progress", headers={"Host": "evil.example"}, auth=basic), 421, "forbidden_host")
        over = b"{" + b" " * BODY_BOUND + b"}"
        shaped(http.post("/txt2img", content=over, auth=basic), 413, "limit_exceeded")  # as declared
        # Chunked, it is the wire's bound (http11.py) that stops it, before any door: its own shape.
        assert http.post("/txt2img", content=iter([over]), auth=basic).status_code == 413
        hires = shaped(http.post("/txt2img", json={"enable_hr": True}, auth=basic), 422, "unsupported")
        assert hires["field"] == "enable_hr" and hires["detail"].startswith("enable_hr: ")
        # The model's own refusal, of our param, names the field as the client sent it.
        cfg = shaped(http.post("/txt2img", json={"steps": 2, "cfg_scale": 500}, auth=basic), 422, "bad_params")
        assert cfg["field"] == "cfg_scale" and cfg["detail"].startswith("cfg_scale (guidance_scale here): ")
        shaped(http.post("/options", json={"samples_format": "jpg"}, auth=basic), 422, "unsupported")
        assert http.get("/progress", auth=basic).json()["state"]["job_count"] == 0  # nothing was started


def test_a_request_that_ended_without_pictures_answers_as_a1111_fails_one() -> None:
    from omni_stream import protocol
    from omni_stream.core.records import RequestRecord
    from omni_stream.server.a1111_api import _ended_error

    record = RequestRecord("r1", owner="c", detach=False, total=2, preview={}, created_at=0.0)
    failed = _ended_error(record, protocol.ErrorMessage.build("step_failed", "boom", request_id="r1",
                                                              field="guidance_scale"))
    body = json.loads(failed.body)
    assert (failed.status_code, body["error"], body["code"], body["field"]) == (500, "RuntimeError", "step_failed",
                                                                               "cfg_scale")
    gone = _ended_error(record, protocol.Cancelled.build("r1", reason="shutdown"))
    assert (gone.status_code, json.loads(gone.body)["code"]) == (503, "shutting_down")


def test_the_door_passes_the_mask_on_blurred_and_at_mask_blur_0_as_it_came() -> None:
    """The mask the door puts in the request (diffusers' inpaint pipelines binarize a mask at 0.5,
    so a tiny pipeline's picture need not show the blur: the mask itself is compared)."""
    import anyio

    from omni_stream.a1111.generation import parse_generation
    from omni_stream.core.limits import ServerLimits
    from omni_stream.params import Param
    from omni_stream.server.a1111_api import A1111Api

    checked: list[Any] = []
    rules = SimpleNamespace(precheck=lambda client, msg, images: checked.append(images))
    door = SimpleNamespace(service=SimpleNamespace(limits=ServerLimits(), rules=rules))
    inpaint = SimpleNamespace(params=[Param("image", "str", None), Param("mask_image", "str", None)])
    sent = io.BytesIO()
    half_mask(16, 16).save(sent, "PNG")
    body = {"init_images": [cb.data_url(cb.picture(16, 16))], "mask": base64.b64encode(sent.getvalue()).decode(),
            "inpaint_full_res": False, "inpainting_fill": 1}  # the whole picture, its pixels as they are

    def passed_on(**fields: Any) -> bytes:
        gen = parse_generation({**body, **fields}, kind="img2img")
        api = A1111Api(door)  # type: ignore[arg-type]
        pending, size = api._images(gen, inpaint)
        assert size == (16, 16)
        urls, area = anyio.run(api._prepared, None, gen, "inpaint", inpaint, {}, pending)
        assert area is not None and area.overlay is not None  # its pictures get A1111's overlay
        return base64.b64decode(urls["mask_image"].partition(",")[2])

    assert passed_on(mask_blur=0) == sent.getvalue()  # bit for bit: the bytes as they came
    soft = np.asarray(Image.open(io.BytesIO(passed_on())))  # A1111's default, 4
    hard = np.asarray(half_mask(16, 16).convert("L"))
    assert len(np.unique(soft)) > 2 and (soft == blurred(hard, 4, 4)).all()  # softened, as A1111's
    across = np.asarray(Image.open(io.BytesIO(passed_on(mask_blur_x=2, mask_blur_y=0))))
    assert (across == blurred(hard, 2, 0)).all()
    assert len(checked) == 3  # the rules asked first, each time: a refused request costs no decode


@pytest.mark.one_loop
@pytest.mark.asyncio
async def test_a_batchs_images_run_together_each_its_own_seed() -> None:
    """batch_size images are requests of one image each (A1111's seed + k), submitted together so
    the engine batches them: fewer denoiser calls than one after another, the same seeds."""
    from omni_stream.models.diffusers import Diffusers

    from .conftest import running

    model = Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings)
    rows: list[int] = []
    model._denoiser.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    body = {"prompt": "a cat", "steps": 3, "seed": 11, "width": 16, "height": 16, "batch_size": 3}
    with one_torch_thread():
        async with running(model) as server, httpx.AsyncClient(base_url=server.http_url, timeout=60) as http:
            made = await http.post("/sdapi/v1/txt2img", json=body)
    assert made.status_code == 200, made.text
    answer = made.json()
    assert len(answer["images"]) == 3 and json.loads(answer["info"])["all_seeds"] == [11, 12, 13]
    assert len(rows) < 3 * 3 and max(rows) > 2  # batched: rows of several requests in one call
