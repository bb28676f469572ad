#!/usr/bin/env python3
"""Redis tier reads with redis-py's C reply parser (hiredis) against its pure-Python one,
side by side in one run on one Redis Cluster.

Command used for benchmarks/history/2026-11-22-storage-tiers.md (repository root, package
installed in .venv with the ``tiers`` extra, which brings hiredis):

    .venv/bin/python benchmarks/bench_redis_parser.py

(defaults: --rows 200000 --dim 64 --partitions 8 --seed 0). Set-up: a real 3-master
Redis Cluster on loopback (tests.storage_fixtures.start_redis_cluster), one table of
--rows random int64 keys x --dim float32 written once. Two RedisClusterStore objects
read that table: ``hiredis`` (redis-py's default when hiredis is importable) and
``python`` (the same store whose connection pools are told to build redis-py's
_RESP2Parser instead; existing connections dropped). Both answer the same uniformly
drawn batches of 64 / 1024 / 16384 keys, in blocks with the order rotating from block to
block (as bench_tiers.run_blocks); keys/s = keys / summed batch time, p50 of the batch
time. Both must return identical vectors (checked).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.abspath(__file__))
while not os.path.isdir(os.path.join(ROOT, "triton_rec")) and os.path.dirname(ROOT) != ROOT:
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from machine import machine_info  # noqa: E402

from tests.storage_fixtures import start_redis_cluster  # noqa: E402
from triton_rec.storage.redis_store import RedisClusterStore  # noqa: E402

BATCHES = {64: 400, 1024: 120, 16384: 16}
ROUNDS = 5


def use_python_parser(store: RedisClusterStore) -> None:
    """Make every connection of ``store`` parse replies with redis-py's Python parser."""
    from redis._parsers import _RESP2Parser

    for node in store._client.get_nodes():
        pool = node.redis_connection.connection_pool
        pool.connection_kwargs["parser_class"] = _RESP2Parser
        pool.disconnect()
        # connections already made keep their parser object: replace it (they are
        # disconnected, so the new parser starts on a fresh socket)
        for conn in list(getattr(pool, "_connections", [])):
            if conn is not None:
                conn._parser = _RESP2Parser(socket_read_size=conn._parser.socket_read_size)


def parser_of(store: RedisClusterStore) -> str:
    node = store._client.get_nodes()[0]
    conn = node.redis_connection.connection_pool.get_connection()
    try:
        conn.connect()
        return type(conn._parser).__name__
    finally:
        node.redis_connection.connection_pool.release(conn)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    keys = rng.choice(np.iinfo(np.int64).max, args.rows, replace=False).astype(np.int64)
    vectors = rng.standard_normal((args.rows, args.dim), dtype=np.float32)
    print(machine_info())
    with start_redis_cluster() as cluster:
        stores = {
            "hiredis": RedisClusterStore(
                cluster.address, "bench.parser", args.dim, num_partitions=args.partitions
            ),
            "python": RedisClusterStore(
                cluster.address, "bench.parser", args.dim, num_partitions=args.partitions
            ),
        }
        try:
            use_python_parser(stores["python"])
            parsers = {name: parser_of(s) for name, s in stores.items()}
            print("parsers:", parsers)  # python: _RESP2Parser, or _RESP3Parser under RESP3
            if parsers["hiredis"] == parsers["python"]:
                print("hiredis is not installed: nothing to compare", file=sys.stderr)
                return 1
            for lo in range(0, args.rows, 65536):
                stores["hiredis"].upsert(keys[lo : lo + 65536], vectors[lo : lo + 65536])
            print(
                "| batch | hiredis keys/s | python keys/s | ratio | hiredis p50 ms | "
                "python p50 ms |"
            )
            print("|---:|---:|---:|---:|---:|---:|")
            for batch, reps in BATCHES.items():
                rows = {m: rng.integers(0, args.rows, (reps, batch)) for m in stores}
                times = {m: [] for m in stores}
                out = {m: np.empty((batch, args.dim), np.float32) for m in stores}
                names = list(stores)
                bounds = [round(reps * r / ROUNDS) for r in range(ROUNDS + 1)]
                for r in range(ROUNDS):
                    for m in names[r % 2 :] + names[: r % 2]:
                        for i in range(bounds[r], bounds[r + 1]):
                            t0 = time.perf_counter()
                            stores[m].fetch(keys[rows[m][i]], out[m])
                            times[m].append(time.perf_counter() - t0)
                            if i == bounds[r]:
                                np.testing.assert_array_equal(out[m], vectors[rows[m][i]])
                kps = {m: batch * reps / sum(times[m]) for m in stores}
                p50 = {m: 1000 * float(np.median(times[m])) for m in stores}
                print(
                    f"| {batch} | {kps['hiredis']:,.0f} | {kps['python']:,.0f} | "
                    f"{kps['hiredis'] / kps['python']:.2f}x | {p50['hiredis']:.2f} | "
                    f"{p50['python']:.2f} |"
                )
        finally:
            for s in stores.values():
                s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
