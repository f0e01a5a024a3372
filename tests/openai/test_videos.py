"""OpenAI's video jobs as our requests (omni_stream/openai/videos.py): the parts issue #39 changed."""

from __future__ import annotations

import pytest

from benchmarks.tenant_inputs import ImageToVideo
from omni_stream.openai import videos as ov
from omni_stream.openai.errors import OpenAIError


def test_seconds_outside_what_the_model_makes_are_refused_with_its_range() -> None:
    # seconds=1e-9 made a one-frame video, which then failed step_failed (issue #39).
    for seconds in (1e-9, 0.05, 8.0):
        request = ov.parse_video_request({"prompt": "x", "seconds": seconds})
        with pytest.raises(OpenAIError) as info:
            request.to_generate(ImageToVideo(), served_name="video")
        assert (info.value.status, info.value.param) == (400, "seconds")
        assert "from 0.125 to 7.875 for model video (a video of 2 to 64 frames at its 8 frames a second)" in (
            info.value.message
        )
    # The ends of the range: 2 and 64 frames.
    for seconds, frames in (("0.125", 2), (7.875, 64)):
        request = ov.parse_video_request({"prompt": "x", "seconds": seconds})
        assert request.to_generate(ImageToVideo(), served_name="video").params["num_frames"] == frames
