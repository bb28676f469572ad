"""Write perf_analyzer ``--input-data`` JSON for an hps model, drawing real keys from its tables.

    python -m triton_rec.clients.perf_inputs --ps-json model_repository/ps.json --model hps_demo \\
        --samples 8 --requests 32 --out build/hps_demo_input.json
    perf_analyzer -m hps_demo --input-data build/hps_demo_input.json

``--unknown-fraction`` mixes in keys that are in no table (answered with defaults),
``--zipf`` draws keys with a Zipf popularity instead of uniformly.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from triton_rec.clients.hps_requests import perf_analyzer_data


def main(argv=None) -> int:
    """Write the perf_analyzer input JSON for one hps model; returns the exit code."""
    from triton_rec.config.ps_json import load_ps_config
    from triton_rec.formats.tables import read_table

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ps-json", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--samples", type=int, default=1, help="samples per request")
    p.add_argument("--requests", type=int, default=16, help="distinct requests in the file")
    p.add_argument("--zipf", type=float, default=0.0, help="Zipf alpha (0 = uniform)")
    p.add_argument("--unknown-fraction", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    params = load_ps_config(args.ps_json).model(args.model)
    rng = np.random.default_rng(args.seed)
    pools = []
    for t in params.tables:
        keys = np.asarray(read_table(t.sparse_file, t.vec_size)[0])
        n_unknown = int(round(len(keys) * args.unknown_fraction))
        if n_unknown:
            known = set(keys.tolist())
            extra = [
                k
                for k in rng.integers(-(2**63), 2**63 - 1, 2 * n_unknown + 8)
                if int(k) not in known
            ]
            keys = np.concatenate([keys, np.asarray(extra[:n_unknown], np.int64)])
        pools.append(keys)
    data = perf_analyzer_data(
        pools,
        [t.max_keys_per_sample for t in params.tables],
        args.samples,
        args.requests,
        args.seed,
        args.zipf,
    )
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f)
    print(f"wrote {args.out}: {args.requests} requests x {args.samples} samples for {args.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
