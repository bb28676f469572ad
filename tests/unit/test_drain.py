"""The drained stop's shared words (src/native/drain.hpp through _native.DrainMap) and the
Python models' side of it (request_loop.run_requests), without a server; the whole stop under
load is tests/e2e/test_lifecycle.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests import fake_pb_utils
from triton_rec.triton import drain as drain_mod
from triton_rec.triton import request_loop


@pytest.fixture
def drain_file(tmp_path, monkeypatch):
    d = drain_mod.DrainFile.create(tmp_path)
    monkeypatch.setenv(drain_mod.DRAIN_FILE_ENV, str(d.path))
    monkeypatch.setattr(drain_mod, "_PROCESS_DRAIN", [])
    yield d
    drain_mod._PROCESS_DRAIN.clear()


def test_the_words_are_shared_between_mappings(drain_file):
    other = drain_mod.DrainFile(drain_file.path)
    assert not other.enter() and drain_file.in_flight == 1
    drain_file.start_draining()
    assert other.draining and other.enter()  # counted, and told to refuse
    other.leave()
    other.leave()
    assert drain_file.in_flight == 0


def _run(pb, requests):
    return request_loop.run_requests(
        pb,
        "m",
        requests,
        ("X",),
        lambda x: x,
        lambda parsed: [p * 2 for p in parsed],
        lambda req, out: pb.InferenceResponse(output_tensors=[pb.Tensor("Y", out)]),
    )


def test_python_models_refuse_retryably_once_draining(drain_file):
    pb = fake_pb_utils.make_module()
    requests = [fake_pb_utils.Request(X=np.arange(3)) for _ in range(3)]
    served = _run(pb, requests)
    assert not any(r.has_error() for r in served) and drain_file.in_flight == 0
    drain_file.start_draining()
    refused = _run(pb, requests)
    assert [r.error.code() for r in refused] == [pb.TritonError.UNAVAILABLE] * 3
    assert all(r.error.message() == drain_mod.STOPPING_MESSAGE for r in refused)
    assert len({id(r.error) for r in refused}) == 3  # one error object per response
    assert drain_file.in_flight == 0


def test_without_a_drain_file_nothing_is_counted(monkeypatch):
    monkeypatch.delenv(drain_mod.DRAIN_FILE_ENV, raising=False)
    monkeypatch.setattr(drain_mod, "_PROCESS_DRAIN", [])
    assert drain_mod.process_drain_file() is None
