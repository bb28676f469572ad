"""Command line: ``python -m triton_rec.updates publish|info ...`` (``--help``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

import numpy as np

from triton_rec.errors import ConfigError, TritonRecError
from triton_rec.storage.backing_store import StoreError
from triton_rec.updates.codec import topic_name
from triton_rec.updates.producer import UpdateProducer
from triton_rec.updates.transport import stream_info


def _sparse_dir_rows(path: str, vec_size: Optional[int]):
    """``(keys, vectors)`` of a HugeCTR sparse directory; ``vec_size`` is inferred from
    the file sizes when not given."""
    import os

    from triton_rec.formats.hugectr_sparse import KEY_FILE, VECTOR_FILE, read_sparse_dir

    if vec_size is None:
        try:
            n = os.path.getsize(os.path.join(path, KEY_FILE)) // 8
            vec_bytes = os.path.getsize(os.path.join(path, VECTOR_FILE))
        except OSError as e:
            raise ValueError(f"{path}: not a HugeCTR sparse directory ({e})") from None
        if n == 0 or vec_bytes % (4 * n) or vec_bytes == 0:
            raise ValueError(
                f"{path}: cannot infer the vector size from {n} keys and "
                f"{vec_bytes} vector bytes; give --vec-size"
            )
        vec_size = vec_bytes // (4 * n)
    return read_sparse_dir(path, vec_size)


def main(argv=None) -> int:
    """Run the command line with ``argv`` (default: sys.argv); returns the exit code."""
    ap = argparse.ArgumentParser(
        prog="python -m triton_rec.updates",
        description="Publish HPS embedding updates to Redis Streams or Kafka topics "
        "(hps_et.<model>.<table>), or show a stream's or topic's state.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, what in (
        ("publish", "publish rows of one table"),
        ("info", "length, consumer groups and pending entries of a topic"),
    ):
        p = sub.add_parser(name, help=what, description=what)
        where = p.add_mutually_exclusive_group(required=True)
        where.add_argument(
            "--address", help="host:port[,host:port...] of the Redis Cluster (Redis Streams)"
        )
        where.add_argument(
            "--brokers", help="host:port[,host:port...] of Kafka brokers (HPS's Kafka topics)"
        )
        p.add_argument("--model", required=True)
        p.add_argument("--table", required=True)
        p.add_argument("--user-name", default=None, help="Redis only")
        p.add_argument("--password", default=None, help="Redis only")
        if name == "info":
            p.add_argument(
                "--group", default=None, help="Kafka only: show this group's committed offsets"
            )
        if name == "publish":
            src = p.add_mutually_exclusive_group(required=True)
            src.add_argument(
                "--npz", help="a .npz with arrays 'keys' (int64 [N]) and 'vectors' (float32 [N, D])"
            )
            src.add_argument(
                "--sparse-dir", help="a HugeCTR sparse table directory (files key, emb_vector)"
            )
            p.add_argument(
                "--vec-size",
                type=int,
                default=None,
                help="floats per vector of --sparse-dir (default: from the file sizes)",
            )
            p.add_argument("--batch-size", type=int, default=8192, help="pairs per message")
            p.add_argument(
                "--maxlen",
                type=int,
                default=None,
                help="Redis only: trim the stream to about N entries",
            )
    args = ap.parse_args(argv)
    conn = dict(user_name=args.user_name, password=args.password)
    try:
        topic = topic_name(args.model, args.table)
        if args.cmd == "info":
            if args.brokers:
                from triton_rec.updates.kafka import kafka_info

                info = kafka_info(args.brokers, args.model, args.table, group=args.group)
            else:
                info = stream_info(args.address, args.model, args.table, **conn)
            print(json.dumps(info, indent=1, default=str))
            return 0
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.npz:
            with np.load(args.npz, allow_pickle=False) as z:
                if "keys" not in z or "vectors" not in z:
                    raise ValueError(
                        f"{args.npz}: needs arrays 'keys' and 'vectors', has {sorted(z.files)}"
                    )
                keys, vectors = z["keys"], z["vectors"]
            if (
                keys.dtype != np.int64
                or keys.ndim != 1
                or vectors.dtype != np.float32
                or vectors.ndim != 2
                or vectors.shape[0] != keys.shape[0]
            ):
                raise ValueError(
                    f"{args.npz}: keys must be int64 [N] and vectors float32 [N, D], "
                    f"got {keys.dtype} {keys.shape} and {vectors.dtype} {vectors.shape}"
                )
        else:
            if args.vec_size is not None and args.vec_size < 1:
                raise ValueError(f"--vec-size must be >= 1, got {args.vec_size}")
            keys, vectors = _sparse_dir_rows(args.sparse_dir, args.vec_size)
        producer: Any
        if args.brokers:
            from triton_rec.updates.kafka import KafkaUpdateProducer

            producer = KafkaUpdateProducer(args.brokers, max_batch_size=args.batch_size)
        else:
            producer = UpdateProducer(
                args.address, maxlen=args.maxlen, max_batch_size=args.batch_size, **conn
            )
        with producer:
            n = producer.publish(args.model, args.table, keys, vectors)
        print(
            f"published {len(keys)} vector(s) of size {vectors.shape[1]} in {n} message(s) "
            f"to {topic}"
        )
        return 0
    except StoreError as e:  # Redis or Kafka unreachable or refusing: not the input's fault
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError, ConfigError, TritonRecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
