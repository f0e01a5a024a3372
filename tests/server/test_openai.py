"""The OpenAI-compatible doors (issue #21), driven by the real ``openai`` SDK against a real server."""

from __future__ import annotations

import base64
import io
from typing import Any

import anyio
import httpx
import pytest
import torch
from PIL import Image

from ..conftest import one_torch_thread
from .conftest import running

openai = pytest.importorskip("openai")
pytest.importorskip("diffusers")

from omni_stream.models.diffusers import Diffusers  # noqa: E402

from ..models import test_diffusers as sd  # noqa: E402
from ..models import test_diffusers_callback as cb  # noqa: E402


def client_for(server: Any, **options: Any) -> Any:
    options.setdefault("api_key", "unused")
    return openai.AsyncOpenAI(base_url=server.http_url + "/v1", max_retries=0, timeout=60, **options)


def reference(pipe: Any, n: int, *, seed: int, height: int = 16, width: int = 24, steps: int = 2) -> list[bytes]:
    emb = sd.fixed_embeddings("a cat", "")
    images = pipe(
        prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds,
        num_inference_steps=steps, height=height, width=width, generator=torch.Generator().manual_seed(seed),
        num_images_per_prompt=n, output_type="pil",
    ).images
    return [image.tobytes() for image in images]


def pixels(data: bytes) -> bytes:
    return Image.open(io.BytesIO(data)).convert("RGB").tobytes()


@pytest.mark.asyncio
async def test_images_generate_answers_the_sdks_images_response() -> None:
    pipe = sd.sd_pipe()
    model = Diffusers(pipe, encode_prompt=sd.fixed_embeddings)
    with one_torch_thread():
        expected = reference(pipe, 2, seed=3)
        async with running(model) as server:
            client = client_for(server)
            two = await client.images.generate(
                prompt="a cat", n=2, size="24x16", extra_body={"steps": 2, "seed": 3}
            )
            urls = await client.images.generate(
                prompt="a cat", size="24x16", response_format="url", output_format="jpeg",
                output_compression=90, extra_body={"steps": 2, "seed": 3},
            )
            async with httpx.AsyncClient(timeout=30) as http:
                fetched = await http.get(urls.data[0].url)
            models = await client.models.list()
            one = await client.models.retrieve("diffusers")
            with pytest.raises(openai.NotFoundError) as missing:
                await client.models.retrieve("gpt-image-1")
    assert [pixels(base64.b64decode(d.b64_json)) for d in two.data] == expected
    assert two.output_format == "png" and two.size == "24x16"
    assert urls.data[0].b64_json is None and fetched.status_code == 200
    assert fetched.headers["content-type"] == "image/jpeg"
    assert Image.open(io.BytesIO(fetched.content)).size == (24, 16)
    assert [m.id for m in models.data] == ["diffusers"] and models.data[0].object == "model"
    assert (one.id, one.object, one.owned_by) == ("diffusers", "model", "omni_stream")
    assert missing.value.status_code == 404 and "diffusers" in str(missing.value)


@pytest.mark.asyncio
async def test_a_streamed_generation_sends_partial_images_then_completed() -> None:
    pipe = sd.sd_pipe()
    model = Diffusers(pipe, encode_prompt=sd.fixed_embeddings)
    with one_torch_thread():
        expected = reference(pipe, 1, seed=4, steps=6)
        expected_two = reference(pipe, 2, seed=5, steps=6)
        async with running(model) as server:
            client = client_for(server)
            stream = await client.images.generate(
                prompt="a cat", size="24x16", stream=True, partial_images=2, extra_body={"steps": 6, "seed": 4}
            )
            events = [event async for event in stream]
            stream = await client.images.generate(
                prompt="a cat", n=2, size="24x16", stream=True, partial_images=1,
                extra_body={"steps": 6, "seed": 5},
            )
            two = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    for event in events[:2]:  # a partial image is the picture so far, full size, in the output format
        assert Image.open(io.BytesIO(base64.b64decode(event.b64_json))).size == (24, 16)
    assert pixels(base64.b64decode(events[-1].b64_json)) == expected[0]
    # n=2: each partial step gives one event per image (image_index), then one completed per image.
    assert [(e.type, e.model_extra["image_index"]) for e in two] == [
        ("image_generation.partial_image", 0), ("image_generation.partial_image", 1),
        ("image_generation.completed", 0), ("image_generation.completed", 1),
    ]
    assert [pixels(base64.b64decode(e.b64_json)) for e in two[2:]] == expected_two


@pytest.mark.asyncio
async def test_n_images_from_the_embedded_default_model() -> None:
    # OpenAI's own sample asks for n; the default model answered 400 "makes one image a
    # request" (issue #34). Each image is the model's, the first the one-image picture.
    from omni_stream.models import Mixture
    from omni_stream.preview.decode import decode_rgb

    def final(**raw: Any) -> torch.Tensor:
        """The request's last frame, straight through the model."""
        model = Mixture()
        params = model.validate({"prompt": "red circle", "size": 64, "steps": 6, "seed": 3, **raw})
        state = model.start(params, torch.device("cpu"))
        for _ in range(model.total_steps(params)):
            frame = model.step([state])[0]
        return frame

    with one_torch_thread():
        two_finals, one_final = final(num_images=2), final()
        async with running(Mixture()) as server:
            client = client_for(server)
            two = await client.images.generate(prompt="red circle", n=2, size="64x64",
                                               extra_body={"steps": 6, "seed": 3})
            stream = await client.images.generate(prompt="red circle", n=2, size="64x64", stream=True,
                                                  partial_images=1, extra_body={"steps": 6, "seed": 3})
            events = [event async for event in stream]
            with pytest.raises(openai.BadRequestError) as over:
                await client.images.generate(prompt="red circle", n=5)  # over the model's num_images (4)
    expected = [decode_rgb(image).tobytes() for image in two_finals]
    assert [pixels(base64.b64decode(d.b64_json)) for d in two.data] == expected
    assert expected[0] == decode_rgb(one_final).tobytes() and expected[0] != expected[1]
    assert two.size == "64x64"
    assert [(e.type, e.model_extra["image_index"]) for e in events] == [
        ("image_generation.partial_image", 0), ("image_generation.partial_image", 1),
        ("image_generation.completed", 0), ("image_generation.completed", 1),
    ]
    assert [pixels(base64.b64decode(e.b64_json)) for e in events[2:]] == expected
    assert over.value.status_code == 400 and "num_images" in over.value.body["message"], over.value.body


@pytest.fixture(scope="module")
def text_encoder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return cb.make_text_encoder(tmp_path_factory.mktemp("clip"))


@pytest.mark.asyncio
async def test_images_edit_runs_the_img2img_pipeline_on_the_uploaded_image(text_encoder: Any) -> None:
    pipe = cb.img2img_pipe(text_encoder)
    model = Diffusers(pipe, mode="callback")
    picture = cb.picture()
    upload = io.BytesIO()
    picture.save(upload, "PNG")
    expected, _ = cb.img2img_reference(pipe, cb.IMG2IMG, picture, "pil")
    async with running(model) as server:
        client = client_for(server)
        edited = await client.images.edit(
            image=("in.png", upload.getvalue(), "image/png"), prompt="a red cat",
            extra_body={"negative_prompt": "dog", "steps": 5, "strength": 0.6, "seed": 3, "guidance_scale": 6.0},
        )
        # OpenAI's multi-image edit (the SDK sends image[] twice): refused whole, saying why.
        with pytest.raises(openai.BadRequestError) as several:
            await client.images.edit(
                image=[("a.png", upload.getvalue(), "image/png"), ("b.png", upload.getvalue(), "image/png")],
                prompt="a red cat",
            )
        text_only = Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings)
    assert pixels(base64.b64decode(edited.data[0].b64_json)) == expected.images[0].tobytes()
    assert (several.value.body["param"], several.value.body["code"]) == ("image", "unsupported")
    assert "one image a call" in several.value.body["message"]
    # One served name for both, as OpenAI's samples use gpt-image-1: generations on the
    # text-to-image pipeline, edits on NAME.edit (the img2img one).
    both = {"gpt-image-1": text_only, "gpt-image-1.edit": model}
    async with running(both) as server:
        client = client_for(server)
        made = await client.images.generate(
            model="gpt-image-1", prompt="a cat", size="24x16", extra_body={"steps": 2, "seed": 3}
        )
        again = await client.images.edit(  # no model: the default's edit pipeline
            image=("in.png", upload.getvalue(), "image/png"), prompt="a red cat",
            extra_body={"negative_prompt": "dog", "steps": 5, "strength": 0.6, "seed": 3, "guidance_scale": 6.0},
        )
    assert Image.open(io.BytesIO(base64.b64decode(made.data[0].b64_json))).size == (24, 16)
    assert pixels(base64.b64decode(again.data[0].b64_json)) == expected.images[0].tobytes()
    async with running(text_only) as server:
        with pytest.raises(openai.BadRequestError) as info:
            await client_for(server).images.edit(image=("in.png", upload.getvalue(), "image/png"), prompt="x")
    assert info.value.body["param"] == "image" and info.value.body["code"] == "unsupported"


@pytest.mark.asyncio
async def test_every_refusal_is_the_sdks_own_exception_in_openais_shape() -> None:
    model = Diffusers(sd.sd_pipe(), encode_prompt=sd.fixed_embeddings)
    async with running(model, token="s3cret", max_requests_per_principal=1) as server:
        client = client_for(server, api_key="s3cret")
        with pytest.raises(openai.BadRequestError) as bad_size:
            await client.images.generate(prompt="a cat", size="big")
        with pytest.raises(openai.BadRequestError) as bad_param:
            await client.images.generate(prompt="a cat", extra_body={"steps": 0})
        with pytest.raises(openai.BadRequestError) as transparent:
            await client.images.generate(prompt="a cat", background="transparent")
        with pytest.raises(openai.NotFoundError) as no_model:
            await client.images.generate(prompt="a cat", model="dall-e-3")
        with pytest.raises(openai.AuthenticationError) as no_token:
            await client_for(server, api_key="wrong").images.generate(prompt="a cat")
        with pytest.raises(openai.AuthenticationError):
            await client_for(server, api_key="wrong").models.list()
        # A second request while the first runs: this principal's one request is held (429).
        slow = await client.images.generate(
            prompt="a cat", stream=True, extra_body={"steps": 900, "height": 16, "width": 16}
        )
        with pytest.raises(openai.RateLimitError) as limited:
            await client.images.generate(prompt="a cat", extra_body={"steps": 1})
        await slow.close()  # hanging up cancels it
    assert bad_size.value.body == {
        "message": bad_size.value.body["message"], "type": "invalid_request_error", "param": "size",
        "code": "invalid_field",
    }
    assert bad_param.value.body["param"] == "steps" and bad_param.value.body["code"] == "bad_params"
    assert transparent.value.body["param"] == "background"
    assert no_model.value.body["param"] == "model"
    assert no_token.value.body["code"] == "unauthorized"
    assert limited.value.body["code"] == "too_many_requests"


def test_the_openai_sdk_against_a_real_omni_stream_serve(tmp_path: Any) -> None:
    # The command users run, in its own process: the sync SDK generates, streams and lists.
    import signal

    from .test_serve import omni_stream_serve

    with one_torch_thread():
        pipe = sd.text_sd_pipe(tmp_path)
        pipe.save_pretrained(tmp_path / "sd")
        expected = pipe(prompt="a red cat", num_inference_steps=3, height=32, width=32, num_images_per_prompt=2,
                        generator=torch.Generator().manual_seed(9), output_type="pil").images
    with omni_stream_serve("--model", f"sd=diffusers:{tmp_path / 'sd'}", "--device", "cpu") as (proc, _, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        made = client.images.generate(prompt="a red cat", n=2, size="32x32", model="sd",
                                      extra_body={"steps": 3, "seed": 9})
        events = list(client.images.generate(prompt="a red cat", size="32x32", stream=True, partial_images=1,
                                              extra_body={"steps": 3, "seed": 9}))
        listed = [m.id for m in client.models.list().data]
        with pytest.raises(openai.BadRequestError):
            client.images.generate(prompt="a red cat", n=9)  # over the server's max_images (4)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert [pixels(base64.b64decode(d.b64_json)) for d in made.data] == [i.tobytes() for i in expected]
    assert [e.type for e in events] == ["image_generation.partial_image", "image_generation.completed"]
    assert pixels(base64.b64decode(events[-1].b64_json)) == expected[0].tobytes()
    assert listed == ["sd"]


def wan_with_a_text_encoder() -> Any:
    """The tiny Wan pipeline, its UMT5 encoder stood in by a function of the prompt: a text-to-video
    pipeline that takes a prompt, as the SDK's videos.create sends one."""
    pipe = cb.wan_pipe()

    def encode_prompt(prompt: Any, negative_prompt: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(len(prompt))  # the prompt matters, deterministically
        return (torch.randn(1, 8, cb.WAN_TEXT_DIM, generator=g), torch.randn(1, 8, cb.WAN_TEXT_DIM, generator=g))

    pipe.encode_prompt = encode_prompt
    return pipe


@pytest.mark.asyncio
async def test_video_jobs_are_created_followed_downloaded_listed_and_deleted() -> None:
    pytest.importorskip("av")
    model = Diffusers(wan_with_a_text_encoder(), mode="callback")
    async with running(model, token=["ann=a", "bob=b"]) as server:
        ann, bob = client_for(server, api_key="a"), client_for(server, api_key="b")
        job = await ann.videos.create(prompt="a red fox", seconds="0.25", size="16x16",
                                      extra_body={"steps": 2, "seed": 1})
        assert job.status in ("queued", "in_progress") and job.object == "video"
        with anyio.fail_after(120):
            while (job := await ann.videos.retrieve(job.id)).status not in ("completed", "failed"):
                await anyio.sleep(0.05)
        # Ours beside OpenAI's fields (its clients ignore it): null, or the restart said, as a job
        # handed over from a lost Ray replica, or resumed after a restart, shows it.
        assert job.model_extra is not None and job.model_extra["restarted"] is None
        record = server.service.rules.registry.get(job.id)
        assert record is not None and record.publish_restarted(1, "replica_lost", rewind=False)
        moved = await ann.videos.retrieve(job.id)
        assert moved.model_extra is not None
        assert moved.model_extra["restarted"] == {"from_step": 1, "reason": "replica_lost"}
        content = await ann.videos.download_content(job.id)
        thumbnail = await ann.videos.download_content(job.id, variant="thumbnail")
        listed = [v.id async for v in ann.videos.list()]
        with pytest.raises(openai.NotFoundError):
            await bob.videos.retrieve(job.id)  # another tenant's job is not there for it
        assert [v.id async for v in bob.videos.list()] == []
        with pytest.raises(openai.BadRequestError) as bad:
            await ann.videos.create(prompt="a fox", seconds="forever")
        deleted = await ann.videos.delete(job.id)
        with pytest.raises(openai.NotFoundError):
            await ann.videos.retrieve(job.id)
    assert job.status == "completed" and job.progress == 100 and job.error is None
    assert (job.size, job.seconds, job.model) == ("16x16", "0.25", "diffusers")
    assert job.completed_at is not None and job.completed_at >= job.created_at
    assert content.content[4:8] == b"ftyp"  # an MP4 (5 frames at 16 fps: 0.25 s)
    assert Image.open(io.BytesIO(thumbnail.content)).format == "WEBP"
    assert listed == [job.id]
    assert bad.value.body["param"] == "seconds"
    assert deleted.deleted and deleted.id == job.id


@pytest.mark.asyncio
async def test_a_video_job_delivers_its_signed_webhook_when_it_ends() -> None:
    pytest.importorskip("standardwebhooks")
    from .test_webhooks import allowed, receiver

    model = Diffusers(wan_with_a_text_encoder(), mode="callback")
    with receiver(200) as hook:
        async with running(model, **allowed(hook)) as server:
            client = client_for(server)
            job = await client.videos.create(
                prompt="a red fox", seconds="0.25", size="16x16",
                extra_body={"steps": 2, "seed": 1, "webhook": {"url": hook.url + "/hooks/video"}},
            )
            with anyio.fail_after(120):
                while not hook.got:
                    await anyio.sleep(0.05)
            with pytest.raises(openai.BadRequestError) as refused:
                await client.videos.create(prompt="a fox", extra_body={"webhook": {"url": "http://10.0.0.1/x"}})
    payload = hook.got[0].verified()
    assert payload["type"] == "generation.completed" and payload["data"]["id"] == job.id
    assert refused.value.body["param"] == "webhook"
