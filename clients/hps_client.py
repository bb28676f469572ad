"""Command-line client for ``hps`` models over HTTP or gRPC.

Examples::

    # keys given by hand, one --table flag per table (table order of ps.json)
    triton-rec-client --model hps_demo --table 11,12 --table 7 --vec-sizes 64,16
    # draw 2 samples of real keys from the model's tables (reads ps.json and the files)
    triton-rec-client --model hps_demo --ps-json model_repository/ps.json --samples 2 \\
        --protocol grpc
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Sequence

import numpy as np

from triton_rec.clients.hps_requests import hps_inputs, split_output


def lookup(
    url: str,
    model: str,
    keys_per_table: Sequence[Sequence[int]],
    protocol: str = "http",
    output: str = "OUTPUT0",
    timeout: float = 60.0,
) -> np.ndarray:
    """Send one lookup and return the flat float32 answer (raises the client's exception)."""
    keys, numkeys = hps_inputs(keys_per_table)
    if protocol == "grpc":
        import tritonclient.grpc as tc
    elif protocol == "http":
        import tritonclient.http as tc
    else:
        raise ValueError(f"protocol must be http or grpc, got {protocol!r}")
    kwargs = {"network_timeout": timeout} if protocol == "http" else {}
    client = tc.InferenceServerClient(url, **kwargs)
    try:
        inputs = [
            tc.InferInput("KEYS", list(keys.shape), "INT64"),
            tc.InferInput("NUMKEYS", list(numkeys.shape), "INT32"),
        ]
        inputs[0].set_data_from_numpy(keys)
        inputs[1].set_data_from_numpy(numkeys)
        outputs = [tc.InferRequestedOutput(output)]
        result = client.infer(model, inputs, outputs=outputs)
        return result.as_numpy(output)
    finally:
        client.close()


def _keys_from_tables(ps_json: str, model: str, samples: int, seed: int):
    from triton_rec.config.ps_json import load_ps_config
    from triton_rec.formats.tables import read_table

    params = load_ps_config(ps_json).model(model)
    rng = np.random.default_rng(seed)
    keys = []
    for t in params.tables:
        table_keys, _ = read_table(t.sparse_file, t.vec_size)
        keys.append(rng.choice(np.asarray(table_keys), samples * t.max_keys_per_sample))
    return keys, [t.vec_size for t in params.tables]


def main(argv: Optional[List[str]] = None) -> int:
    """Command line entry point (``triton-rec-client``); returns the exit status."""
    p = argparse.ArgumentParser(
        prog="triton-rec-client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--url", help="server address (default localhost:8000 http, localhost:8001 grpc)"
    )
    p.add_argument("--protocol", choices=("http", "grpc"), default="http")
    p.add_argument("--model", required=True)
    p.add_argument("--output", default="OUTPUT0", help="output tensor name")
    p.add_argument(
        "--table",
        action="append",
        default=[],
        metavar="K1,K2,...",
        help="keys of the next table (repeat once per table; may be empty: '')",
    )
    p.add_argument("--vec-sizes", help="comma-separated vector size per table (to print per key)")
    p.add_argument("--ps-json", help="draw keys from the model's tables named in this ps.json")
    p.add_argument("--samples", type=int, default=1, help="samples to draw with --ps-json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = p.parse_args(argv)

    url = args.url or ("localhost:8001" if args.protocol == "grpc" else "localhost:8000")
    if args.ps_json:
        keys, vec_sizes = _keys_from_tables(args.ps_json, args.model, args.samples, args.seed)
    elif args.table:
        keys = [[int(k) for k in t.split(",") if k.strip()] for t in args.table]
        vec_sizes = [int(v) for v in args.vec_sizes.split(",")] if args.vec_sizes else None
    else:
        p.error("give --table (once per table) or --ps-json")
    try:
        out = lookup(url, args.model, keys, args.protocol, args.output)
    except Exception as e:  # the client's InferenceServerException carries the server's message
        print(f"error: {e}", file=sys.stderr)
        return 1
    counts = [len(k) for k in keys]
    if args.json:
        result = {
            "counts": counts,
            "keys": [np.asarray(k).tolist() for k in keys],
            "output": out.tolist(),
        }
        print(json.dumps(result))
        return 0
    print(f"{args.model}: {sum(counts)} keys -> {out.shape[0]} floats")
    if vec_sizes:
        np.set_printoptions(precision=4, suppress=True, threshold=12, edgeitems=3)
        for t, (k, v) in enumerate(zip(keys, split_output(out, counts, vec_sizes))):
            for key, vec in zip(k, v):
                print(f"  table {t} key {int(key)}: {vec}")
    else:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
