"""DES / CATCOLUMN / ROWINDEX: validation and regrouping of sample-major keys by table."""

import numpy as np
import pytest

from triton_rec.errors import RequestError
from triton_rec.serving.hugectr_request import parse_embedding_request, parse_hugectr_request


def _build(samples, dense_dim=3, dtype=np.int64):
    """samples: list (per sample) of list (per table) of list (per slot) of keys.
    Built the way a HugeCTR client does: CATCOLUMN sample-major, ROWINDEX per table."""
    n, n_tables = len(samples), len(samples[0])
    cat = [k for s in samples for table in s for slot in table for k in slot]
    rowindex = []
    for t in range(n_tables):
        rp = [0]
        for s in samples:
            for slot in s[t]:
                rp.append(rp[-1] + len(slot))
        rowindex += rp
    des = np.arange(n * dense_dim, dtype=np.float32)
    return des, np.array(cat, dtype=dtype), np.array(rowindex, np.int32)


SAMPLES = [
    [[[1], [2, 3]], [[10], [], [11, 12, 13]]],
    [[[4], []], [[14], [15], [16]]],
    [[[], [5]], [[], [], []]],
]


@pytest.mark.parametrize("dtype", [np.int64, np.uint32])
def test_sample_major_keys_are_regrouped_by_table_with_their_own_row_pointers(dtype):
    des, cat, rows = _build(SAMPLES, dtype=dtype)
    r = parse_hugectr_request("m", des, cat, rows, slots=[2, 3], dense_dim=3, max_batch_size=8)
    assert r.num_samples == 3
    assert r.keys[0].tolist() == [1, 2, 3, 4, 5] and r.keys[0].dtype == np.int64
    assert r.keys[1].tolist() == [10, 11, 12, 13, 14, 15, 16]
    assert r.row_ptrs[0].tolist() == [0, 1, 3, 4, 4, 4, 5]
    assert r.row_ptrs[1].tolist() == [0, 1, 1, 4, 5, 6, 7, 7, 7, 7]
    np.testing.assert_array_equal(r.dense, des.reshape(3, 3))


def test_the_documented_dlrm_single_sample_layout():
    des = np.zeros(13, np.float32)
    cat = np.arange(26, dtype=np.uint32)
    rows = np.arange(27, dtype=np.int32)
    r = parse_hugectr_request("dlrm", des, cat, rows, slots=[26], dense_dim=13, max_batch_size=64)
    assert r.num_samples == 1 and r.keys[0].tolist() == list(range(26))


def test_the_documented_wdl_layout_of_ten_samples():
    rows = np.concatenate([np.arange(21), np.arange(261)]).astype(np.int32)
    cat = np.arange(280, dtype=np.int64)
    r = parse_hugectr_request("wdl", np.zeros(130, np.float32), cat, rows, [2, 26], 13, 64)
    assert r.num_samples == 10
    # sample 0: keys 0,1 (table 0) then 2..27 (table 1); sample 1 starts at 28
    assert r.keys[0][:4].tolist() == [0, 1, 28, 29]
    assert r.keys[1][:2].tolist() == [2, 3] and r.keys[1][26] == 30


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (
            lambda d, c, r: (d, c, np.concatenate([r[:2], [0], r[3:]]).astype(np.int32)),
            "decreases at position",
        ),
        (
            lambda d, c, r: (d, c[:-1], r),
            "ROWINDEX points to 12 keys but CATCOLUMN has 11 (ROWINDEX points past the end",
        ),
        (
            lambda d, c, r: (d, np.concatenate([c, c[:1]]), r),
            "ROWINDEX points to 12 keys but CATCOLUMN has 13",
        ),
        (lambda d, c, r: (d[:-1], c, r), "DES has 8 values, not a multiple of dense_dim 3"),
        (lambda d, c, r: (d[:6], c, r), "DES holds 2 samples but ROWINDEX holds 3"),
        (
            lambda d, c, r: (np.where(np.arange(9) == 4, np.nan, d).astype(np.float32), c, r),
            "non-finite value (nan) at sample 1, feature 1",
        ),
        (
            lambda d, c, r: (np.where(np.arange(9) == 8, np.inf, d).astype(np.float32), c, r),
            "non-finite value (inf) at sample 2, feature 2",
        ),
        (
            lambda d, c, r: (d, c, r[:-1]),
            "ROWINDEX has 16 values; expected num_samples * 5 slots + 2",
        ),
        (lambda d, c, r: (d, c, (r + 1).astype(np.int32)), "must start at 0"),
        (lambda d, c, r: (d.astype(np.float64), c, r), "DES must be FP32"),
        (lambda d, c, r: (d, c.astype(np.int32), r), "CATCOLUMN must be UINT32 or INT64"),
        (lambda d, c, r: (d, c, r.astype(np.int64)), "ROWINDEX must be INT32"),
        (lambda d, c, r: (d[:0], c[:0], r[:0]), "empty request"),
    ],
)
def test_malformed_requests_are_rejected_with_the_tensor_named(mutate, needle):
    des, cat, rows = mutate(*_build(SAMPLES))
    with pytest.raises(RequestError) as e:
        parse_hugectr_request("m", des, cat, rows, slots=[2, 3], dense_dim=3, max_batch_size=8)
    assert needle in str(e.value), str(e.value)


def test_more_samples_than_max_batch_size_are_rejected():
    des, cat, rows = _build(SAMPLES)
    with pytest.raises(RequestError, match="holds 3 samples, more than max_batch_size 2"):
        parse_hugectr_request("m", des, cat, rows, slots=[2, 3], dense_dim=3, max_batch_size=2)


def _random_samples(rng, n, slots, max_keys):
    return [
        [
            [
                rng.integers(-(2**40), 2**40, rng.integers(0, max_keys + 1)).tolist()
                for _ in range(s)
            ]
            for s in slots
        ]
        for _ in range(n)
    ]


@pytest.mark.parametrize("seed", range(8))
def test_the_native_regrouping_matches_the_samples_table_by_table(seed):
    rng = np.random.default_rng(seed)
    slots = rng.integers(1, 6, rng.integers(1, 5)).tolist()
    n = int(rng.integers(1, 40))
    samples = _random_samples(rng, n, slots, 4)
    des, cat, rows = _build(samples)
    r = parse_hugectr_request("m", des, cat, rows, slots=slots, dense_dim=3, max_batch_size=64)
    for t in range(len(slots)):
        assert r.keys[t].tolist() == [k for smp in samples for slot in smp[t] for k in slot]
        counts = [len(slot) for smp in samples for slot in smp[t]]
        assert r.row_ptrs[t].tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist()


@pytest.mark.parametrize("seed", range(8))
def test_a_damaged_rowindex_always_gets_a_request_error(seed):
    # Whatever the native pass rejects, the reference checks explain (never a crash).
    rng = np.random.default_rng(100 + seed)
    slots = [2, 3]
    des, cat, rows = _build(_random_samples(rng, 5, slots, 3))
    rows = rows.copy()
    rows[rng.integers(0, rows.size)] += int(rng.choice([-3, -1, 1, 5]))
    try:
        parse_hugectr_request("m", des, cat, rows, slots=slots, dense_dim=3, max_batch_size=64)
    except RequestError as e:
        assert "ROWINDEX" in str(e)


def _embedding_request(n=3, slots=(2, 1), vec=(4, 2)):
    """A dense-backend (ensemble) request: one key per slot, EMBEDDINGS table-major."""
    rows = np.concatenate([np.arange(n * s + 1) for s in slots]).astype(np.int32)
    embs = np.arange(sum(n * s * v for s, v in zip(slots, vec)), dtype=np.float32)
    return np.zeros(n * 3, np.float32), embs, rows


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("tensor", ["DES", "EMBEDDINGS"])
def test_the_dense_backend_refuses_non_finite_embeddings_as_it_refuses_non_finite_des(
    tensor, value
):
    # Issue 24: EMBEDDINGS follows DES's rule, naming the input and where the value is.
    des, embs, rows = _embedding_request()
    n, dense, vectors, _ = parse_embedding_request("m", des, embs, rows, (2, 1), (4, 2), 3, 8)
    assert n == 3 and [v.shape for v in vectors] == [(6, 4), (3, 2)]
    if tensor == "DES":
        des[4] = value
        needle = f"DES holds a non-finite value ({np.float32(value)}) at sample 1, feature 1"
    else:
        # table 1 starts after table 0's 6 keys x 4 floats; its key 2 is sample 2's slot 0
        embs[24 + 2 * 2 + 1] = value
        needle = (
            f"EMBEDDINGS holds a non-finite value ({np.float32(value)}) at sample 2, table 1, "
            "slot 0 (the table's key 2), element 1"
        )
    with pytest.raises(RequestError) as e:
        parse_embedding_request("m", des, embs, rows, (2, 1), (4, 2), 3, 8)
    assert needle in str(e.value), str(e.value)


def test_embeddings_of_a_multi_hot_slot_name_the_sample_that_holds_them():
    # table 0: sample 0 has slots of 0 and 3 keys, sample 1 has 1 and 0 keys
    rows = np.array([0, 0, 3, 4, 4], np.int32)
    embs = np.zeros(4 * 2, np.float32)
    embs[3 * 2] = np.nan  # key 3: sample 1, slot 0
    with pytest.raises(RequestError, match=r"at sample 1, table 0, slot 0 \(the table's key 3\)"):
        parse_embedding_request("m", np.zeros(2, np.float32), embs, rows, (2,), (2,), 1, 8)
    embs[3 * 2], embs[2 * 2 + 1] = 0, -np.inf  # key 2: sample 0, slot 1
    with pytest.raises(RequestError, match=r"\(-inf\) at sample 0, table 0, slot 1 .*element 1"):
        parse_embedding_request("m", np.zeros(2, np.float32), embs, rows, (2,), (2,), 1, 8)
    # denormals and values near the float32 limit are finite: accepted
    embs[2 * 2 + 1] = 3e38
    embs[0] = 1e-45
    parse_embedding_request("m", np.zeros(2, np.float32), embs, rows, (2,), (2,), 1, 8)


@pytest.mark.parametrize("dtype", [np.int64, np.uint32])
@pytest.mark.parametrize("n", [1, 255, 256, 257, 700, 20_037])
def test_one_key_per_slot_is_regrouped_as_the_samples_say(dtype, n):
    """Every slot one key (one-hot tables, MLPerf's DLRM): the native regrouping's transpose
    in runs of 256 samples gives each table its keys in sample order, as the general case
    does; tables of one and of several slots in one request. 20,037 samples split across
    two cores where the machine has them, the last part short: the transpose's runs
    (kRegroupSamplesPerPart) and the row pointers' tables (kWidenPointersPerPart), a
    disordered block in a later part refused as in the first."""
    rng = np.random.default_rng(n)
    slots = [1, 3, 1, 2]
    hi = 2**32 if dtype == np.uint32 else 2**40
    samples = [[[[int(rng.integers(0, hi))] for _ in range(s)] for s in slots] for _ in range(n)]
    des, cat, rows = _build(samples, dtype=dtype)
    assert all(v == j for t in range(4) for j, v in enumerate(_table_block(rows, slots, n, t)))
    r = parse_hugectr_request("m", des, cat, rows, slots=slots, dense_dim=3, max_batch_size=1 << 15)
    for t in range(len(slots)):
        assert r.keys[t].tolist() == [k for smp in samples for slot in smp[t] for k in slot]
        assert r.row_ptrs[t].tolist() == list(range(n * slots[t] + 1))
    for t in (0, 3):  # a block out of order, in the first table or the last
        bad = rows.copy()
        start = sum(n * sl + 1 for sl in slots[:t])
        bad[start + n // 2], bad[start + n // 2 + 1] = bad[start + n // 2 + 1], bad[start + n // 2]
        with pytest.raises(RequestError, match="ROWINDEX"):
            parse_hugectr_request("m", des, cat, bad, slots, dense_dim=3, max_batch_size=1 << 15)
    # the same key counts, but one slot with two keys and one with none: the general case
    samples[0][1][0].append(7)
    samples[-1][1][-1].clear()
    des, cat, rows = _build(samples, dtype=dtype)
    r = parse_hugectr_request("m", des, cat, rows, slots=slots, dense_dim=3, max_batch_size=1 << 15)
    assert r.keys[1].tolist() == [k for smp in samples for slot in smp[1] for k in slot]
    counts = [len(slot) for smp in samples for slot in smp[1]]
    assert r.row_ptrs[1].tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist()


def _table_block(rows, slots, n, t):
    start = sum(n * s + 1 for s in slots[:t])
    return rows[start : start + n * slots[t] + 1].tolist()
