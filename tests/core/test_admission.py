"""Checks before a generate reaches the engine: preview settings and params."""

from __future__ import annotations

import pytest

import omni_stream as om
from omni_stream.models import Synthetic
from omni_stream.preview import PreviewSpec
from omni_stream.protocol import MessageError
from omni_stream.core.admission import (
    DEVICE_FRAMES_PER_REQUEST,
    HOST_BATCH_RETAINED_BYTES,
    HOST_FRAMES_PER_BATCH,
    HOST_FRAMES_PER_LARGE_BATCH,
    HOST_FRAMES_PER_REQUEST,
    LATENT_RATIO,
    REQUEST_BASE_BYTES,
    RESULT_COPIES,
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    Load,
    OutputSpec,
    ServerBusyError,
    cap_preview,
    check_load,
    check_params,
    default_decoder,
    estimate_memory,
    frame_bytes,
    host_batch_cost,
    host_engines,
    output_spec,
    preview_spec,
    reserve_memory,
    retry_after,
    state_on_host,
)
from omni_stream.core.limits import HOST_ACTIVE_PER_ENGINE, ServerLimits
from omni_stream.core.outbox import MemoryBudget

LIMITS = ServerLimits(max_steps=50, max_image_size=256)
MIB = 1 << 20


def spec(wire: dict | None) -> PreviewSpec:
    return preview_spec(
        wire, default=PreviewSpec(), decoder="rgb", limits=LIMITS, request_id="r"
    )


def test_preview_defaults_and_caps() -> None:
    assert spec(None) == PreviewSpec()
    assert spec({"format": "png"}).max_size == 256  # 512 by default, capped
    assert spec({"max_size": None}).max_size == 256
    assert spec({"max_size": 64}).max_size == 64
    assert cap_preview(PreviewSpec(max_size=100), LIMITS).max_size == 100


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        ({"format": "bmp"}, "preview.format"),
        ({"every": 0}, "preview.every"),
        ({"quality": 101}, "preview.quality"),
        ({"format": "png", "quality": 50}, "preview.quality"),
        ({"max_size": 0}, "preview.max_size"),
        ({"decoder": "builtins:eval"}, "preview.decoder"),
        ({"size": 3}, "preview.size"),
    ],
)
def test_bad_preview_names_the_option(wire: dict, field: str) -> None:
    with pytest.raises(MessageError) as info:
        spec(wire)
    assert (info.value.code, info.value.field, info.value.request_id) == ("invalid_field", field, "r")


def test_params_are_checked_by_the_model_then_the_limits() -> None:
    model = Synthetic()
    assert check_params(model, {"steps": 50}, LIMITS, request_id="r")[0] == 50
    with pytest.raises(MessageError) as info:
        check_params(model, {"steps": "ten"}, LIMITS, request_id="r")
    assert (info.value.code, info.value.field, info.value.request_id) == ("bad_params", "steps", "r")
    with pytest.raises(MessageError) as info:
        check_params(model, {"steps": 51}, LIMITS, request_id="r")
    assert (info.value.code, info.value.field, info.value.request_id) == ("limit_exceeded", "steps", "r")


def test_default_decoder_follows_the_model() -> None:
    model = Synthetic()
    assert default_decoder(model) == "auto"  # by the frame's shape
    model.preview_decoder = "sd15"  # type: ignore[attr-defined]
    assert default_decoder(model) == "sd15"


def test_output_settings_are_checked_and_defaulted() -> None:
    assert output_spec(None, video=False, request_id="r") == OutputSpec("png")
    assert output_spec({"format": "jpeg", "quality": 90}, video=False, request_id="r") == OutputSpec("jpeg", 90)
    assert output_spec({"format": "gif"}, video=True, request_id="r") == OutputSpec("gif")
    cases = [
        ({"format": "mp4"}, False, "output.format"),
        ({"format": "png"}, True, "output.format"),
        ({"format": "png", "quality": 50}, False, "output.quality"),
        ({"format": "jpeg", "quality": 0}, False, "output.quality"),
        ({"size": 3}, False, "output.size"),
    ]
    for wire, video, field in cases:
        with pytest.raises(MessageError) as info:
            output_spec(wire, video=video, request_id="r")
        assert (info.value.code, info.value.field, info.value.request_id) == ("invalid_field", field, "r")


def test_over_the_wire_an_image_param_must_be_a_data_url() -> None:
    class TakesImage(Synthetic):
        params = (*Synthetic.params, om.Param("image", "str", ""))

    opened: list[str] = []

    class Reading(TakesImage):
        def validate(self, params):
            opened.append(params.get("image"))  # a real model would read the file here
            return super().validate(params)

    with pytest.raises(MessageError) as info:
        check_params(Reading(), {"image": "/etc/passwd"}, LIMITS, request_id="r")
    assert (info.value.code, info.value.field) == ("bad_params", "image")
    assert "data: URL" in info.value.message
    assert opened == [], "the path must be refused before the model reads it"


def _png_url(width: int, height: int) -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class _TakesImage(Synthetic):
    """Synthetic with an image param that its validate decodes (as img2img pipelines do)."""

    params = (*Synthetic.params, om.Param("image", "str", None))
    decoded = 0

    def validate(self, params):
        from omni_stream.models.inputs import load_image

        params = dict(params)
        image = params.pop("image", None)
        out = super().validate(params)
        if isinstance(image, str):
            type(self).decoded += 1
            image = load_image(image)
        return {**out, "image": image}


def test_an_input_image_larger_than_max_image_size_is_refused_from_its_header_before_a_decode() -> None:
    limits = ServerLimits(max_image_size=64)
    model = _TakesImage()
    total, params = check_params(model, {"image": _png_url(64, 8)}, limits, request_id="r")
    assert total == 20 and params.checked["image"].size == (64, 8) and _TakesImage.decoded == 1
    with pytest.raises(MessageError) as info:
        check_params(model, {"image": _png_url(65, 8)}, limits, request_id="r")
    assert (info.value.code, info.value.field) == ("limit_exceeded", "image")
    assert "65x8" in info.value.message
    assert _TakesImage.decoded == 1  # refused from the header: never decoded


def test_an_input_image_counts_at_its_decoded_size_in_the_memory_estimate() -> None:
    # A 1024x1024 input to an image-to-image model renders at that size: it
    # is estimated as a request of that size, not of the model's default one
    # (issue #19, finding 7: 0.25 MiB reserved, +379 MiB used).
    limits = ServerLimits()
    model = _TakesImage()
    _, small = check_params(model, {"image": _png_url(16, 16)}, limits, request_id="r")
    _, large = check_params(model, {"image": _png_url(1024, 1024)}, limits, request_id="r")
    big = estimate_memory(model, large.checked)
    assert big.field == "image"
    assert big.alone > 1024 * 1024 * 3 * 4 * 6  # at least its frames at 1024x1024
    assert big.alone > 50 * estimate_memory(model, small.checked).alone


# -- load: max_active, max_queued, fair shares, retry_after ---------------------------


def test_load_splits_what_the_engine_holds_into_active_and_queued() -> None:
    limits = ServerLimits(max_active=4, max_queued=6)
    load = Load.of(3, 4, limits, engine_batch_size=8)  # engine statistics: started, not yet
    assert (load.held, load.active, load.queued, load.capacity) == (7, 4, 3, 10)
    assert not load.busy and not load.crowded  # 3 of 6 queued: half, not over
    assert Load(8, 4, 6).crowded and not Load(8, 4, 6).busy
    assert Load(10, 4, 6).busy
    assert load.to_dict() == {"active": 4, "queued": 3, "max_active": 4, "max_queued": 6}
    assert Load(0, 4, 6).to_dict()["active"] == 0
    # Fair share: the whole capacity split between the open connections, at least 1.
    assert [Load(8, 4, 6).fair_share(n) for n in (0, 1, 3, 64)] == [10, 10, 3, 1]


def test_max_active_defaults_to_two_engine_batches_on_an_accelerator_and_four_on_the_cpu() -> None:
    assert ServerLimits().max_active is None and ServerLimits().max_queued == 128
    assert ServerLimits().active_bound(8) == 16
    assert ServerLimits().active_bound(1) == 2  # a whole-request model
    assert ServerLimits(max_active=5).active_bound(8) == 5
    assert Load.of(0, 0, ServerLimits(), engine_batch_size=4).max_active == 8
    # Computing on the host CPU: a batch costs its steps one by one, so
    # more requests in the engine only divide the frames a second.
    assert HOST_ACTIVE_PER_ENGINE == 4
    assert ServerLimits().active_bound(8, host_engines=1) == 4
    assert ServerLimits().active_bound(8, host_engines=3) == 12  # a group of three CPU engines
    assert ServerLimits(max_active=5).active_bound(8, host_engines=1) == 5  # set: as set
    assert Load.of(0, 0, ServerLimits(), engine_batch_size=8, host_engines=1).max_active == 4


class _Dev:
    def __init__(self, on_cpu: bool) -> None:
        self.computes_on_cpu = on_cpu


class _Eng:
    def __init__(self, device: _Dev | None = None, members: list[_Eng] | None = None) -> None:
        if device is not None:
            self.device = device
        if members is not None:
            self.members = members


def test_host_engines_counts_the_engines_that_compute_on_this_cpu() -> None:
    assert host_engines(_Eng(_Dev(True))) == 1
    assert host_engines(_Eng(_Dev(False))) == 0  # CUDA
    assert host_engines(_Eng(members=[_Eng(_Dev(True)), _Eng(_Dev(True))])) == 2
    # A group with an accelerator in it keeps the accelerator's rule.
    assert host_engines(_Eng(members=[_Eng(_Dev(True)), _Eng(_Dev(False))])) == 0
    # Cannot see a device (a Ray deployment's replicas count for themselves).
    assert host_engines(_Eng()) == 0


@pytest.mark.asyncio
async def test_the_real_cpu_and_sim_engines_count_as_host_engines() -> None:
    for device in ("cpu", "sim"):
        async with om.Engine(Synthetic(), device=device) as engine:
            assert host_engines(engine) == 1, device


def test_load_limits_come_from_keywords_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_STREAM_MAX_ACTIVE", "3")
    monkeypatch.setenv("OMNI_STREAM_MAX_QUEUED", "9")
    monkeypatch.setenv("OMNI_STREAM_MAX_FRAMES", "33")
    limits = ServerLimits.from_env({})
    assert (limits.max_active, limits.max_queued, limits.max_frames) == (3, 9, 33)
    assert ServerLimits.from_env({"max_queued": 2}).max_queued == 2
    monkeypatch.setenv("OMNI_STREAM_MAX_ACTIVE", "zero")
    assert ServerLimits.from_env({}).max_active is None  # warned; the engine-derived default
    for bad in ({"max_active": 0}, {"max_queued": 0}, {"max_queued": None}, {"max_active": 1.5},
                {"max_frames": True}):
        with pytest.raises(om.ParamsError) as info:
            ServerLimits.from_env(bad)
        assert info.value.field == next(iter(bad))


def _busy(load: Load, *, own: int = 0, principals: int = 1) -> MessageError | None:
    try:
        check_load(load, own=own, principals=principals, retry_after_s=lambda: 7.5, request_id="r")
    except MessageError as exc:
        return exc
    return None


def test_check_load_refuses_past_capacity_with_busy_and_retry_after() -> None:
    assert _busy(Load(9, 4, 6)) is None
    err = _busy(Load(10, 4, 6))
    assert isinstance(err, ServerBusyError)
    assert (err.code, err.request_id, err.retry_after_s) == ("busy", "r", 7.5)
    assert "max_active + max_queued" in err.message and "OMNI_STREAM_MAX_QUEUED" in err.message


def test_check_load_gives_each_connection_a_fair_share_once_the_queue_is_over_half_full() -> None:
    calm, crowded = Load(7, 4, 6), Load(8, 4, 6)  # 3 and 4 of 6 queued
    # One connection alone may use everything.
    assert _busy(crowded, own=8, principals=1) is None
    # Two open: a share is 10 // 2 = 5 once crowded, not before.
    assert _busy(calm, own=7, principals=2) is None
    assert _busy(crowded, own=4, principals=2) is None
    err = _busy(crowded, own=5, principals=2)
    assert err is not None and err.code == "busy" and "fair share of 5" in err.message
    # Sixty-four connections: one request each, and a newcomer still gets in.
    assert _busy(crowded, own=1, principals=64) is not None
    assert _busy(crowded, own=0, principals=64) is None


def test_retry_after_estimates_when_a_slot_frees_clamped() -> None:
    # 16 held, batches of 8: each steps every 2 calls of 0.1 s; the nearest ends in 20 steps.
    assert retry_after([50, 20, 300], held=16, step_s=0.1, batch_size=8) == 4.0
    # A whole-request model runs one at a time: 20 calls.
    assert retry_after([50, 20], held=16, step_s=0.1, batch_size=1, whole_requests=True) == 2.0
    assert retry_after([3], held=2, step_s=0.001, batch_size=8) == RETRY_AFTER_MIN_S
    assert retry_after([10_000], held=80, step_s=0.05, batch_size=8) == RETRY_AFTER_MAX_S
    # Nothing known yet: the minimum.
    assert retry_after([], held=4, step_s=0.1, batch_size=8) == RETRY_AFTER_MIN_S
    assert retry_after([10], held=4, step_s=None, batch_size=None) == RETRY_AFTER_MIN_S
    assert retry_after([10], held=4, step_s=0.5, batch_size=None) == 20.0
    assert retry_after([1], held=1, step_s=1.23, batch_size=1) == 1.3  # rounded up


# -- bounds of the params themselves ----------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"shape": [64, 2048, 2048]}, "shape"),
        ({"shape": [5, 1024, 1024]}, "shape"),
        ({"work": 1001}, "work"),
        ({"hang_at": 1, "hang_s": 600.5}, "hang_s"),
    ],
)
def test_synthetic_params_are_bounded_by_the_model(params: dict, field: str) -> None:
    limits = ServerLimits(max_image_size=4096)
    with pytest.raises(MessageError) as info:
        check_params(Synthetic(), params, limits, request_id="r")
    assert (info.value.code, info.value.field) == ("bad_params", field)
    with pytest.raises(om.ParamsError) as direct:
        Synthetic().validate(params)
    assert direct.value.field == field


def test_synthetic_params_at_the_models_bounds_pass() -> None:
    from omni_stream.models.synthetic import MAX_ELEMENTS, MAX_HANG_S, MAX_WORK

    ok = Synthetic().validate({"shape": [4, 1024, 1024], "work": MAX_WORK, "hang_s": MAX_HANG_S})
    assert MAX_ELEMENTS == 4 * 1024 * 1024 and ok["work"] == MAX_WORK
    assert Synthetic().validate({"hang_at": 2})["hang_s"] == MAX_HANG_S


def test_num_frames_is_bounded_by_max_frames() -> None:
    class Video(Synthetic):
        params = (*Synthetic.params, om.Param("num_frames", "int", 49, minimum=1, maximum=2048))

    limits = ServerLimits(max_frames=121)
    assert check_params(Video(), {"num_frames": 121}, limits, request_id="r")[0] == 20
    with pytest.raises(MessageError) as info:
        check_params(Video(), {"num_frames": 122}, limits, request_id="r")
    assert (info.value.code, info.value.field) == ("limit_exceeded", "num_frames")
    assert "OMNI_STREAM_MAX_FRAMES" in info.value.message and info.value.request_id == "r"
    assert ServerLimits().max_frames == 257


def test_priority_parses_within_its_range() -> None:
    from omni_stream import protocol
    from omni_stream.engine.scheduler import PRIORITY_MAX, PRIORITY_MIN

    assert (protocol.MIN_PRIORITY, protocol.MAX_PRIORITY) == (PRIORITY_MIN, PRIORITY_MAX)
    parse = protocol.parse_client_message
    assert parse('{"type": "generate", "params": {}}').priority == 0
    assert parse('{"type": "generate", "params": {}, "priority": -10}').priority == -10
    for bad in ("11", "-11", "1.5", "true", '"2"', "null", "1e400"):
        with pytest.raises(MessageError) as info:
            parse(f'{{"type": "generate", "id": "p", "params": {{}}, "priority": {bad}}}')
        assert (info.value.code, info.value.field, info.value.request_id) == ("invalid_field", "priority", "p")


# -- memory ---------------------------------------------------------------------------


def test_frame_bytes_come_from_a_shape_param_or_the_image_sides() -> None:
    assert frame_bytes(Synthetic(), {"shape": [3, 64, 32]}) == (3 * 64 * 32 * 4, "shape")
    assert frame_bytes(Synthetic(), {}) == (4 * 64 * 64 * 4, "shape")  # the model's default shape
    mixture = om.models.Mixture()
    assert frame_bytes(mixture, {"size": 100}) == (3 * 100 * 100 * 4, "size")
    assert frame_bytes(om.from_generator(lambda p: iter(())), {"steps": 3}) is None


def test_a_given_size_is_not_hidden_by_the_default_sides() -> None:
    # A pipeline declares size beside height and width (defaults 64 here): a
    # request of size 2048 was costed at the default width, 64x64.
    class Pipe(Synthetic):
        params = (om.Param("steps", "int", 4, minimum=1), om.Param("size", "int", None, minimum=8),
                  om.Param("height", "int", 64, minimum=8), om.Param("width", "int", 64, minimum=8))

    assert frame_bytes(Pipe(), {"size": 2048}) == (3 * 2048 * 2048 * 4, "size")
    assert frame_bytes(Pipe(), {}) == (3 * 64 * 64 * 4, "width")
    assert frame_bytes(Pipe(), {"width": 128}) == (3 * 128 * 64 * 4, "width")


def test_the_taesd_decoder_is_refused_at_admission_for_a_model_without_a_tiny_vae() -> None:
    with pytest.raises(MessageError) as info:
        preview_spec({"decoder": "taesd"}, default=PreviewSpec(), decoder="rgb", limits=LIMITS,
                     request_id="r", model=om.models.Mixture())
    assert (info.value.code, info.value.field, info.value.request_id) == ("invalid_field", "preview.decoder", "r")
    assert "--preview-vae" in info.value.message and "OMNI_STREAM_PREVIEW_VAE" in info.value.message


def test_the_estimate_is_a_base_plus_frames_own_and_shared_with_the_batch() -> None:
    f = 3 * 64 * 64 * 4
    est = estimate_memory(Synthetic(), {"shape": [3, 64, 64], "work": 2}, on_host=True, batch_size=8)
    assert est.own == REQUEST_BASE_BYTES + HOST_FRAMES_PER_REQUEST * f
    assert est.shared == f and est.batch_cost is host_batch_cost
    assert est.alone == est.own + HOST_FRAMES_PER_BATCH * f
    assert est.group == ("batch", ((3, 64, 64), 2)) and est.batch_size == 8
    assert est.field == "shape"
    on_device = estimate_memory(Synthetic(), {"shape": [3, 64, 64]}, on_host=False, batch_size=8)
    assert (on_device.own, on_device.shared) == (REQUEST_BASE_BYTES + DEVICE_FRAMES_PER_REQUEST * f, 0)
    assert on_device.alone == on_device.own


def test_a_batchs_cost_per_frame_falls_past_what_the_allocator_keeps() -> None:
    small = HOST_BATCH_RETAINED_BYTES
    assert host_batch_cost(0) == 0
    assert host_batch_cost(small) == HOST_FRAMES_PER_BATCH * small
    assert host_batch_cost(small + MIB) == HOST_FRAMES_PER_BATCH * small + HOST_FRAMES_PER_LARGE_BATCH * MIB
    costs = [host_batch_cost(n * MIB) for n in range(64)]
    assert costs == sorted(costs)  # more frames never cost less


def test_a_model_may_state_its_own_memory() -> None:
    class Stated(Synthetic):
        def memory_bytes(self, params: dict) -> int | None:
            return None if params["steps"] == 1 else 1234 * params["steps"]

    assert estimate_memory(Stated(), {"steps": 2}).alone == 2468
    assert estimate_memory(Stated(), {"steps": 1}).alone > 2468  # None: the server's estimate


def test_state_on_host_follows_the_engines_device() -> None:
    class Dev:
        def __init__(self, on_cpu: bool) -> None:
            self.computes_on_cpu = on_cpu

    class One:
        def __init__(self, on_cpu: bool) -> None:
            self.device = Dev(on_cpu)

    class Group:
        def __init__(self, *members: One) -> None:
            self.members = members

    assert state_on_host(One(True)) and not state_on_host(One(False))
    assert state_on_host(Group(One(False), One(True))) and not state_on_host(Group(One(False)))
    assert state_on_host(object())  # cannot tell: counted


def test_a_decoded_video_result_on_an_accelerator_counts_its_latents_not_four_results() -> None:
    class Video(Synthetic):
        params = (
            om.Param("width", "int", 480, minimum=8, maximum=4096),
            om.Param("height", "int", 720, minimum=8, maximum=4096),
            om.Param("num_frames", "int", 49, minimum=1, maximum=2048),
        )

        def total_steps(self, params: dict) -> int:
            return 30

    result = 3 * 480 * 720 * 49 * 4  # the decoded float32 result: 203 MB
    on_device = estimate_memory(Video(), {}, on_host=False)
    assert on_device.field == "width" and on_device.frame_bytes == result
    expected = RESULT_COPIES + DEVICE_FRAMES_PER_REQUEST / LATENT_RATIO
    assert on_device.own == REQUEST_BASE_BYTES + int(expected * result)
    assert on_device.own_per_byte == expected
    # On the host the frames are what the engine computes on: counted as before.
    assert estimate_memory(Video(), {}, on_host=True).own == REQUEST_BASE_BYTES + HOST_FRAMES_PER_REQUEST * result

    class Gpu:
        class device:  # noqa: N801 - an engine's device, as state_on_host reads it
            computes_on_cpu = False

        max_batch_size = 1

    # The standard 49 x 720 x 480 video fits the default bound (1 GiB: half
    # of it for one request); it did not when counted as 4 results (813 MB).
    limit = ServerLimits.from_env({}).max_memory_bytes
    budget = MemoryBudget(limit)
    held = reserve_memory(budget, Video(), {}, engine=Gpu(), request_id="v")
    assert held.own <= limit // 2 < 4 * result
    held.release()


def test_a_request_over_half_the_memory_bound_is_refused_naming_the_limit() -> None:
    budget = MemoryBudget(64 * MIB)
    with pytest.raises(MessageError) as info:
        reserve_memory(budget, Synthetic(), {"shape": [3, 1024, 1024]}, request_id="r")
    err = info.value
    assert (err.code, err.field, err.request_id) == ("limit_exceeded", "shape", "r")
    assert "max_memory_bytes=67108864" in err.message
    assert "OMNI_STREAM_MAX_MEMORY_BYTES" in err.message
    assert budget.reserved == 0


def test_a_request_that_does_not_fit_beside_the_others_gets_busy_until_one_ends() -> None:
    params = {"shape": [3, 128, 128]}
    alone = estimate_memory(Synthetic(), params).alone  # small frames: twice one costs twice
    budget = MemoryBudget(2 * alone + 1000)
    held = [reserve_memory(budget, Synthetic(), dict(params, seed=i), request_id=str(i)) for i in range(2)]
    assert budget.reserved == 2 * alone
    with pytest.raises(ServerBusyError) as info:
        reserve_memory(budget, Synthetic(), params, request_id="third", retry_after_s=lambda: 7.5)
    err = info.value
    assert (err.code, err.retry_after_s, err.request_id) == ("busy", 7.5, "third")
    assert "max_memory_bytes" in err.message and "OMNI_STREAM_MAX_MEMORY_BYTES" in err.message
    held[0].release()
    held[0].release()  # idempotent
    third = reserve_memory(budget, Synthetic(), params, request_id="third")
    assert budget.reserved == 2 * alone
    third.release()
    held[1].release()
    assert budget.reserved == 0


def test_queued_messages_count_when_admitting() -> None:
    params = {"shape": [3, 128, 128]}
    alone = estimate_memory(Synthetic(), params).alone
    budget = MemoryBudget(2 * alone)
    budget.add(alone + 1)  # messages queued for clients
    with pytest.raises(ServerBusyError):
        reserve_memory(budget, Synthetic(), params, request_id="r")
    budget.release(1)
    reserve_memory(budget, Synthetic(), params, request_id="r").release()


def test_requests_batched_together_share_one_batch_of_temporaries() -> None:
    # The batch's cost counts for the largest batch only: two shapes batch apart.
    small, big = {"shape": [3, 64, 64]}, {"shape": [3, 128, 128]}
    budget = MemoryBudget(1 << 30)

    class Engine:
        max_batch_size = 2

    a = reserve_memory(budget, Synthetic(), small, engine=Engine(), request_id="a")
    b = reserve_memory(budget, Synthetic(), big, engine=Engine(), request_id="b")
    f_big = 3 * 128 * 128 * 4
    assert budget.reserved == a.own + b.own + host_batch_cost(f_big)  # not a's: the larger batch counts
    c = [reserve_memory(budget, Synthetic(), big, engine=Engine(), request_id=f"c{i}") for i in range(2)]
    # Three of that shape, but at most two in a model call.
    assert budget.reserved == a.own + 3 * b.own + host_batch_cost(2 * f_big)
    for r in (a, b, *c):
        r.release()
    assert budget.reserved == 0


def test_a_picture_over_the_memory_bound_is_answered_with_the_largest_size_that_fits() -> None:
    # Issue #37: OpenAI's sora-2 sample asked for the video's default size and got a 400 saying
    # only "ask for a smaller size". The answer names the largest size of its aspect that fits.
    class Video(Synthetic):
        params = (
            om.Param("width", "int", 1280, minimum=8, maximum=4096),
            om.Param("height", "int", 720, minimum=8, maximum=4096),
            om.Param("num_frames", "int", 49, minimum=1, maximum=2048),
        )

        def total_steps(self, params: dict) -> int:
            return 30

    from omni_stream.core.estimate import MAX_REQUEST_MEMORY_SHARE

    budget = MemoryBudget(256 * MIB)
    with pytest.raises(MessageError) as info:
        reserve_memory(budget, Video(), {}, request_id="v")
    err = info.value
    assert (err.code, err.field) == ("limit_exceeded", "width")
    suggested = err.message.rsplit("the largest that fits here is ", 1)[1]
    width, height = (int(side) for side in suggested.split("x"))
    assert width % 64 == 0 and height % 64 == 0 and width < 1280 and abs(width / height - 1280 / 720) < 0.3
    cap = int(budget.limit * MAX_REQUEST_MEMORY_SHARE)
    assert estimate_memory(Video(), {"width": width, "height": height}).alone <= cap
    wider = {"width": width + 64, "height": (720 * (width + 64) // 1280) // 64 * 64}
    assert estimate_memory(Video(), wider).alone > cap
    reserve_memory(budget, Video(), {"width": width, "height": height}, request_id="v2").release()
    # A frame that is not a picture (Synthetic's shape) gets no size to try.
    with pytest.raises(MessageError) as shaped:
        reserve_memory(MemoryBudget(64 * MIB), Synthetic(), {"shape": [3, 1024, 1024]}, request_id="s")
    assert "largest that fits" not in shaped.value.message
