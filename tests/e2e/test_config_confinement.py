"""Opt-in path confinement against a real tritonserver: with ``TRITON_REC_ALLOWED_ROOTS``
set to the repository, a model whose tables live elsewhere (named by an absolute path,
or through a symlink inside the repository) fails to load with a message naming the
file and the roots, while a model inside the roots serves exact answers."""

import json
import os

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from tests.e2e.conftest import hps_config, make_client
from triton_rec.config.model_files import ALLOWED_ROOTS_ENV
from triton_rec.triton.runtime import TritonServer

TABLES = [SyntheticTable("t", rows=200, vec_size=8, max_keys_per_sample=2, default_value=0.5)]
SEED = 11


@pytest.fixture(scope="module")
def confined(tmp_path_factory, nothing_left_in_dev_shm):
    base = tmp_path_factory.mktemp("confine")
    repo, outside, store = base / "repo", base / "outside", base / "store"
    inside = write_model(str(repo), "inside", TABLES, seed=SEED)
    away = write_model(str(outside), "away", TABLES, seed=SEED)
    away["sparse_files"] = [str(outside / f) for f in away["sparse_files"]]
    linked = dict(away, model="linked", sparse_files=["linked/t_link.model"])
    (repo / "linked").mkdir(parents=True)
    os.symlink(away["sparse_files"][0], repo / "linked" / "t_link.model")
    (repo / "ps.json").write_text(
        json.dumps({"supportlonglong": True, "models": [inside, away, linked]})
    )
    for name in ("inside", "away", "linked"):
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "config.pbtxt").write_text(
            hps_config(
                name, 1, extra='parameters { key: "metrics_interval" value: { string_value: "0" } }'
            )
        )
    srv = TritonServer(
        repo,
        explicit=True,
        load_models=["inside"],
        log_path=base / "tritonserver.log",
        env={"TRITON_REC_STORE": str(store), ALLOWED_ROOTS_ENV: str(repo)},
    )
    srv.start()
    yield srv, repo, outside
    srv.stop()


@pytest.mark.parametrize("model", ["away", "linked"])
def test_a_model_outside_the_roots_fails_to_load_and_the_other_serves(confined, model):
    import tritonclient.http as tc
    from tritonclient.utils import InferenceServerException

    srv, repo, outside = confined
    with make_client(srv, "http") as client:
        with pytest.raises(InferenceServerException) as e:
            client.load_model(model)
        msg = str(e.value)
        assert f"{outside}/away/" in msg and "/key: sparse file" in msg, msg
        assert f"is outside the allowed roots ['{repo}']" in msg and ALLOWED_ROOTS_ENV in msg, msg
        assert not client.is_model_ready(model)
        assert client.is_server_live() and client.is_model_ready("inside")

        keys = table_keys(SEED, 0, 200)[[3, 17, 150]]
        ask = np.concatenate([keys, [-77]]).astype(np.int64)[None]
        ins = [
            tc.InferInput("KEYS", list(ask.shape), "INT64"),
            tc.InferInput("NUMKEYS", [1, 1], "INT32"),
        ]
        ins[0].set_data_from_numpy(ask)
        ins[1].set_data_from_numpy(np.array([[4]], np.int32))
        out = client.infer("inside", ins).as_numpy("OUTPUT0").reshape(4, 8)
    np.testing.assert_array_equal(out[:3], expected_vectors(SEED, 0, keys, 8))
    np.testing.assert_array_equal(out[3], np.full(8, 0.5, np.float32))
