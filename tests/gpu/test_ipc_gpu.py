"""One device cache shared by two processes through CUDA IPC: the second process attaches
(not the owner), reads what the first inserted through the kernels, and its inserts are
seen by the first."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid

import numpy as np

from triton_rec.cache.gpu_share import open_shared_cache

CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from triton_rec.cache.gpu_share import open_shared_cache
    name, directory = sys.argv[1], sys.argv[2]
    c = open_shared_cache(name, 4096, 16, device=0, directory=directory)
    keys = np.arange(1000, dtype=np.int64)
    out = np.empty((1000, 16), np.float32)
    hit = np.empty(1000, np.uint8)
    hits = c.query(keys, out, hit)
    new = np.arange(5000, 5100, dtype=np.int64)
    c.insert(new, np.tile(new[:, None].astype(np.float32), (1, 16)))
    print(json.dumps({"owner": c.owner, "hits": int(hits), "sum": float(out[hit == 1].sum())}))
    c.close()
    """
)


def test_a_second_process_attaches_and_shares_the_cache(cupy, tmp_path):
    name = f"ipc-{uuid.uuid4().hex[:8]}"
    cache = open_shared_cache(name, 4096, 16, device=0, directory=str(tmp_path))
    try:
        assert cache.owner and cache.kind == "cuda"
        keys = np.arange(1000, dtype=np.int64)
        vectors = np.tile(keys[:, None].astype(np.float32), (1, 16))
        cache.insert(keys, vectors)
        out = np.empty((1000, 16), np.float32)
        hit = np.empty(1000, np.uint8)
        mine = cache.query(keys, out, hit)
        child = subprocess.run(
            [sys.executable, "-c", CHILD, name, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == 0, child.stderr
        got = json.loads(child.stdout.strip().splitlines()[-1])
        assert got["owner"] is False
        assert got["hits"] == mine > 900  # the same cache, seen from the other process
        assert got["sum"] == float(out[hit == 1].sum())
        new = np.arange(5000, 5100, dtype=np.int64)
        out2 = np.empty((100, 16), np.float32)
        hit2 = np.empty(100, np.uint8)
        assert cache.query(new, out2, hit2) > 90  # the child's inserts are here
        assert np.array_equal(out2[hit2 == 1, 0], new[hit2 == 1].astype(np.float32))
    finally:
        cache.close(linger=1.0)
