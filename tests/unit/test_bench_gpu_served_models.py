"""benchmarks/bench_gpu_served.py's many-table model (``hps_many``) and the repository
it serves: made without a server or a GPU (the benchmark itself ran with
``--gpu-kind KIND_CPU --models hps_many,dlrm_hps``)."""

import json
import os

import numpy as np

from tests.benchmark_scripts import load_benchmark
from triton_rec.formats.tables import read_table


def test_hps_many_is_26_tables_in_every_variant_and_its_requests_ask_each(tmp_path):
    bench = load_benchmark("bench_gpu_served")
    sources = bench.model_sources(["hps_many"], str(tmp_path / "src"))
    base, entry, cfg = sources["hps_many"]
    spec = bench.SYNTHETIC["hps_many"]
    assert len(entry["sparse_files"]) == spec["tables"] == 26
    keys, vectors = read_table(os.path.join(base, entry["sparse_files"][5]), spec["dim"])
    assert keys.size == spec["rows"] and vectors.shape == (spec["rows"], spec["dim"])
    assert 'name: "hps_many"' in cfg and 'backend: "hps"' in cfg
    repo = bench.build_repository(str(tmp_path / "repo"), 2, 3, "KIND_CPU", sources)
    served = {m["model"]: m for m in json.load(open(os.path.join(repo, "ps.json")))["models"]}
    for v in bench.VARIANTS:
        text = open(os.path.join(repo, f"hps_many_{v}", "config.pbtxt")).read()
        assert f'name: "hps_many_{v}"' in text
        if v != "floor":  # the floor serves no tables
            files = served[f"hps_many_{v}"]["sparse_files"]
            assert len(files) == 26 and all(os.path.isdir(os.path.join(repo, f)) for f in files)
    assert served["hps_many_gpu_static"]["embedding_cache_type"] == "static"
    assert served["hps_many_cpu_mapped"]["gpucache"] is False
    ((body, head),) = bench.hps_bodies(sources["hps_many"], 64, 1, np.random.default_rng(0))
    shapes = {i["name"]: i["shape"] for i in json.loads(body[:head])["inputs"]}
    assert shapes == {"KEYS": [64 * 26], "NUMKEYS": [26]}
    numkeys = np.frombuffer(body[head + 64 * 26 * 8 :], np.int32)
    assert numkeys.tolist() == [64] * 26


def test_dlrm_dense_runs_the_dlrms_network_in_three_variants_on_the_looked_up_vectors(tmp_path):
    bench = load_benchmark("bench_gpu_served")
    sources = bench.model_sources(["dlrm_dense"], str(tmp_path / "src"))
    base, entry, cfg = sources["dlrm_dense"]
    assert entry["model"] == "dlrm" and 'backend: "dense"' in cfg
    repo = bench.build_repository(str(tmp_path / "repo"), 1, 1, "KIND_CPU", sources)
    assert sorted(os.listdir(repo)) == [
        "dlrm_dense_cpu",
        "dlrm_dense_floor",
        "dlrm_dense_gpu",
        "ps.json",
    ]
    served = {m["model"]: m for m in json.load(open(os.path.join(repo, "ps.json")))["models"]}
    for v in ("gpu", "cpu"):  # each variant runs the network of its own ps.json entry
        text = open(os.path.join(repo, f"dlrm_dense_{v}", "config.pbtxt")).read()
        assert f'key: "ps_model" value: {{ string_value: "dlrm_dense_{v}" }}' in text
        assert os.path.exists(os.path.join(repo, served[f"dlrm_dense_{v}"]["dense_file"]))
    floor = open(os.path.join(repo, "dlrm_dense_floor", "config.pbtxt")).read()
    assert 'backend: "trec_floor"' in floor and '"EMBEDDINGS"' in floor and "ps_model" not in floor
    ((body, head),) = bench.dense_bodies(sources["dlrm_dense"], 8, 1)
    header = json.loads(body[:head])
    shapes = {i["name"]: i["shape"][0] for i in header["inputs"]}
    sizes = {i["name"]: i["parameters"]["binary_data_size"] for i in header["inputs"]}
    # EMBEDDINGS: every key's row of its table, table-major, in the samples' order
    emb = np.frombuffer(body[head + sizes["DES"] :][: sizes["EMBEDDINGS"]], np.float32)
    data = bench._dlrm_samples(8, 1).ensemble_request(0, 8)
    want, start = [], 0
    for t, (p, v) in enumerate(zip(entry["sparse_files"], entry["embedding_vecsize_per_table"])):
        keys, vectors = read_table(os.path.join(base, p), v)
        row = {int(k): i for i, k in enumerate(keys)}
        part = data["KEYS"][start : start + int(data["NUMKEYS"][t])]
        start += part.size
        want.append(np.stack([vectors[row[int(k)]] for k in part]).reshape(-1))
    assert np.array_equal(emb, np.concatenate(want))
    assert shapes["EMBEDDINGS"] == emb.size and shapes["ROWINDEX"] == data["ROWINDEX"].size
