"""fuzz_hooks.py's image drawing for the edit form's array of files, without a server: what schemathesis 4.32.5
would send for POST /v1/images/edits of a document with max_images 3 (fuzzing-phase cases)."""
from __future__ import annotations

import dataclasses
import io

import jsonschema
import pytest
from PIL import Image

schemathesis = pytest.importorskip("schemathesis")
fuzz_hooks = pytest.importorskip("fuzz_hooks")  # registers the hooks globally (as SCHEMATHESIS_HOOKS does)

from hypothesis import HealthCheck, given, settings  # noqa: E402

from omni.engine_loop import EngineLoop  # noqa: E402
from omni.scheduler import Scheduler  # noqa: E402
from omni.serving.app import ModelHelpers, ServingOptions, create_app  # noqa: E402
from serving_harness import FakePipeline  # noqa: E402


def test_edit_cases_carry_one_to_max_images_real_files_as_repeated_parts():
    """Each generated edit's ``image`` is a list of 1..3 real images sent as file parts ``image`` (a filename,
    the media type drawn); a positive case is one the document allows; together they cover 1, 2 and 3 files. Without the
    hooks' map / flatmap a lone image went out as a part without a filename (a text field to the server)."""
    helpers = dataclasses.replace(ModelHelpers.plain(), max_images=3)
    app = create_app(EngineLoop.around(Scheduler(FakePipeline(num_pages=64), max_running=1)),
                     ServingOptions(model_id="x", helpers=helpers))
    doc = app.openapi()
    operation = schemathesis.openapi.from_dict(doc)["/v1/images/edits"]["POST"]
    schema = doc["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    counts = set()

    @given(case=operation.as_strategy())
    @settings(max_examples=60, suppress_health_check=list(HealthCheck), database=None, deadline=None)
    def check(case):
        if not isinstance(case.body, dict) or "image" not in case.body:
            return
        images = case.body["image"]
        assert isinstance(images, list) and 1 <= len(images) <= 3, images
        parts = [(v[0], v[1], v[2]) for name, v in case.as_transport_kwargs(base_url="http://x")["files"]
                 if name == "image"]
        assert len(parts) == len(images)
        for filename, data, media_type in parts:
            assert filename and media_type.startswith("image/")
            assert Image.open(io.BytesIO(data)).format == fuzz_hooks.FORMATS[media_type]
        if case.meta.generation.mode.name == "POSITIVE":  # the document allows what is sent
            assert jsonschema.Draft202012Validator(schema).is_valid(fuzz_hooks.files_as_text(case.body))
        counts.add(len(images))

    check()
    assert counts == {1, 2, 3}, counts
