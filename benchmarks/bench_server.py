#!/usr/bin/env python3
"""Load time and memory of the ``hps`` backend in a REAL tritonserver, big table.

One run, everything on loopback, every server stopped, everything created deleted at
the end (unless --keep). It writes a model repository with one ``hps`` model whose one
table is --rows x --dim float32 (default 4.1M x 256 = 4.2 GB of vectors; keys are a
shuffled unique int64 range, vectors np.random.default_rng(seed).random(float32) written
in chunks), ps.json with ``gpucache: true`` and a small ``gpucacheper``, a fresh
node-local store (``TRITON_REC_STORE``), then measures:

  first load     fresh store: the backend converts the table into the store while the
                 model loads (the source is evicted from the page cache first, so it is
                 read from disk; --first-load-warm keeps it cached)
  second load    a new server process, store already populated, layout in the page
                 cache: --reps times with prefault on (default) and off
  cold           second load after evicting the layout only (posix_fadvise DONTNEED)
                 and after ``sync; echo 3 > /proc/sys/vm/drop_caches`` (root only; this
                 also evicts tritonserver's and Python's own files), prefault on / off
  no autocomplete  second load with tritonserver --disable-auto-complete-config, --reps times
  small table    first + second loads of a --small-rows table (default ~0.25 GB)
  memory         a second-load server per instance count (--instances, default 1,2,4):
                 total PSS / RSS of the instance processes (/proc/<pid>/smaps_rollup)
                 after one lookup, the /dev/shm cache segment

Start-to-ready = from Popen of tritonserver until /v2/health/ready answers 200 (polled
every --poll s). The server log's timestamps split it: first log line, each instance's
"hps model ... ready", "successfully loaded". Every server answers one lookup of 64
random known keys, checked equal to the vectors written (exact).

    python benchmarks/bench_server.py [--rows 4100000] [--dim 256] [--small-rows 245000]
        [--instances 1,2,4] [--reps 3] [--dir /tmp] [--no-cold] [--keep] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton_rec.formats.hugectr_sparse import KEY_FILE, VECTOR_FILE  # noqa: E402
from triton_rec.storage import node_store  # noqa: E402
from triton_rec.triton.runtime import TritonServer, prepare_backend_dir  # noqa: E402
from triton_rec.util.procfs import smaps_rollup  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import evict_files, machine_info  # noqa: E402

KEY_BASE = 1_000_000_007  # keys are KEY_BASE + a permutation of range(rows)
CHUNK_BYTES = 64 << 20
PROBE_POOL = 4096  # rows whose vectors are kept to check answers
HPS_IO = """
input [
  { name: "KEYS" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true },
  { name: "NUMKEYS" data_type: TYPE_INT32 dims: [ -1 ] allow_ragged_batch: true }
]
"""


def hps_config(name: str, count: int, extra: str = "") -> str:
    """config.pbtxt as tests/e2e/conftest.py::hps_config writes it."""
    return (
        f'name: "{name}"\nbackend: "hps"\nmax_batch_size: 1024\n{HPS_IO}'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        "dynamic_batching { max_queue_delay_microseconds: 500 }\n"
        f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]\n{extra}"
    )


NO_AUTOCOMPLETE = "--disable-auto-complete-config"
PREFAULT_OFF = 'parameters { key: "prefault" value: { string_value: "false" } }\n'


# -- machine ------------------------------------------------------------------------------


def loadavg() -> str:
    with contextlib.suppress(OSError):
        return " ".join(open("/proc/loadavg").read().split()[:3])
    return "?"


# -- page cache ---------------------------------------------------------------------------


def warm_file(path: str) -> float:
    """Read a file once (into the page cache); seconds."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - t0


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> float:
    t0 = time.perf_counter()
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    return time.perf_counter() - t0


def cached_fraction(path: str) -> float:
    """Fraction of a file's pages in the page cache (mincore(2) over a read-only map)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page, step, resident = mmap.PAGESIZE, 1 << 30, 0
    with open(path, "rb") as f:
        for off in range(0, size, step):
            length = min(step, size - off)
            mm = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ, offset=off)
            view = np.frombuffer(mm, np.uint8)
            vec = np.zeros((length + page - 1) // page, np.uint8)
            rc = libc.mincore(view.__array_interface__["data"][0], length, vec.ctypes.data)
            del view
            mm.close()
            if rc != 0:
                return float("nan")
            resident += int(np.count_nonzero(vec & 1))
    return resident / ((size + page - 1) // page)


# -- table --------------------------------------------------------------------------------


def write_table(table_dir: Path, rows: int, dim: int, seed: int):
    """A HugeCTR sparse directory; returns (seconds, probe keys, probe vectors)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    table_dir.mkdir(parents=True, exist_ok=True)
    keys = KEY_BASE + rng.permutation(rows).astype(np.int64)
    keys.tofile(table_dir / KEY_FILE)
    probe_rows = np.sort(rng.choice(rows, min(PROBE_POOL, rows), replace=False))
    probe_vecs = np.empty((probe_rows.shape[0], dim), np.float32)
    step = max(1, CHUNK_BYTES // (4 * dim))
    with open(table_dir / VECTOR_FILE, "wb") as f:
        for start in range(0, rows, step):
            n = min(step, rows - start)
            chunk = rng.random((n, dim), dtype=np.float32)
            sel = (probe_rows >= start) & (probe_rows < start + n)
            probe_vecs[sel] = chunk[probe_rows[sel] - start]
            f.write(chunk.data)
    probe_keys = keys[probe_rows].copy()
    return time.perf_counter() - t0, probe_keys, probe_vecs


class Model:
    """One repository holding one hps model with one table."""

    def __init__(self, root: Path, name: str, rows: int, dim: int, seed: int, gpucacheper: float):
        self.name, self.rows, self.dim = name, rows, dim
        self.repo = root / f"repo_{name}"
        self.table_dir = self.repo / name / "1" / f"{name}0_sparse_0.model"
        self.write_seconds, self.probe_keys, self.probe_vecs = write_table(
            self.table_dir, rows, dim, seed
        )
        self.table_bytes = rows * 8 + rows * dim * 4
        entry = {
            "model": name,
            "sparse_files": [os.path.relpath(self.table_dir, self.repo)],
            "embedding_table_names": ["emb"],
            "embedding_vecsize_per_table": [dim],
            "maxnum_catfeature_query_per_table_per_sample": [1],
            "max_batch_size": 1024,
            "default_value_for_each_table": [-1.0],
            "gpucache": True,
            "gpucacheper": gpucacheper,
            # > 1: misses are always fetched synchronously, so every answer is exact.
            "hit_rate_threshold": 1.1,
        }
        (self.repo / "ps.json").write_text(
            json.dumps({"supportlonglong": True, "models": [entry]}, indent=1)
        )
        self.set_config(1, True)

    def set_config(self, count: int, prefault: bool) -> None:
        (self.repo / self.name / "config.pbtxt").write_text(
            hps_config(self.name, count, "" if prefault else PREFAULT_OFF)
        )

    def source_files(self):
        return [self.table_dir / KEY_FILE, self.table_dir / VECTOR_FILE]


# -- server -------------------------------------------------------------------------------


class TimedServer(TritonServer):
    """TritonServer whose start() records the wall time of Popen and the time to ready."""

    def start(self, timeout: float = 600.0, poll: float = 0.02) -> TimedServer:
        prepare_backend_dir(self.backend_dir)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        env = self.environment()
        self.popen_wall = time.time()
        t0 = time.perf_counter()
        self.process = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        while time.perf_counter() - t0 < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if self.is_ready():
                self.ready_seconds = time.perf_counter() - t0
                return self
            time.sleep(poll)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {timeout} s:\n{self.log_tail()}")


_LOG_LINE = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +\d+ [^\]]*\] ?(.*)$")


def log_events(log_path: Path, popen_wall: float, model: str) -> dict:
    """Seconds after Popen of the server log's milestones (log timestamps are local time)."""
    year = datetime.fromtimestamp(popen_wall).year
    ev = {"first_log": None, "instance_init": [], "instance_ready": [], "loaded": None}
    for line in log_path.read_text(errors="replace").splitlines():
        m = _LOG_LINE.match(line)
        if not m:
            continue
        mo, d, hh, mm, ss, us, msg = m.groups()
        t = (
            datetime(year, int(mo), int(d), int(hh), int(mm), int(ss), int(us)).timestamp()
            - popen_wall
        )
        if ev["first_log"] is None:
            ev["first_log"] = t
        if (
            "TRITONBACKEND_ModelInstanceInitialize:" in msg
            and f"{model}_" in msg
            and "successful" not in msg
        ):
            ev["instance_init"].append(t)
        if f"hps model '{model}' ready" in msg:
            ev["instance_ready"].append(t)
        if ev["loaded"] is None and "successfully loaded" in msg and f"'{model}'" in msg:
            ev["loaded"] = t
    return ev


def lookup(server: TritonServer, model: str, keys: np.ndarray) -> tuple:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    try:
        k = keys.astype(np.int64)[None, :]
        n = np.array([[k.shape[1]]], np.int32)
        ins = [
            httpclient.InferInput("KEYS", list(k.shape), "INT64"),
            httpclient.InferInput("NUMKEYS", list(n.shape), "INT32"),
        ]
        ins[0].set_data_from_numpy(k)
        ins[1].set_data_from_numpy(n)
        t0 = time.perf_counter()
        res = client.infer(model, ins, outputs=[httpclient.InferRequestedOutput("OUTPUT0")])
        return res.as_numpy("OUTPUT0"), time.perf_counter() - t0
    finally:
        client.close()


def shm_segments(model: str) -> list:
    segs = []
    for e in sorted(os.listdir("/dev/shm")):
        if e.startswith("trec_") and f"{model}." in e:
            st = os.stat(os.path.join("/dev/shm", e))
            segs.append({"name": e, "size": st.st_size, "allocated": st.st_blocks * 512})
    return segs


class Bench:
    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.store = work / "store"
        self.logs = Path(args.log_dir) if args.log_dir else work / "logs"
        self.runs = []
        self.rng = np.random.default_rng(args.seed + 1)

    def serve(
        self,
        model: Model,
        label: str,
        count: int = 1,
        prefault: bool = True,
        cache: str = "warm",
        memory: bool = False,
        extra_args=(),
    ) -> dict:
        model.set_config(count, prefault)
        n = len(self.runs)
        log = self.logs / f"{n:02d}_{model.name}_{label.replace(' ', '_')}.log"
        srv = TimedServer(
            model.repo,
            log_path=log,
            env={"TRITON_REC_STORE": str(self.store)},
            extra_args=list(extra_args),
        )
        srv.start(timeout=self.args.timeout, poll=self.args.poll)
        run = {
            "model": model.name,
            "label": label,
            "count": count,
            "prefault": prefault,
            "cache": cache,
            "ready_s": srv.ready_seconds,
        }
        try:
            pick = self.rng.choice(model.probe_keys.shape[0], 64, replace=False)
            out, run["first_lookup_s"] = lookup(srv, model.name, model.probe_keys[pick])
            run["correct"] = bool(np.array_equal(out, model.probe_vecs[pick].reshape(-1)))
            _, run["second_lookup_s"] = lookup(srv, model.name, model.probe_keys[pick])
            pids = srv.backend_pids(model.name)
            run["instances"] = len(pids)
            if memory:
                rolls = [smaps_rollup(p) for p in pids]
                run["mem"] = {
                    k: sum(r.get(k, 0) for r in rolls)
                    for k in (
                        "Rss",
                        "Pss",
                        "Pss_Anon",
                        "Pss_File",
                        "Pss_Shmem",
                        "Shared_Clean",
                        "Private_Clean",
                        "Private_Dirty",
                    )
                }
                run["mem_per_instance"] = [{k: r.get(k, 0) for k in ("Rss", "Pss")} for r in rolls]
            run["shm"] = shm_segments(model.name)
        finally:
            srv.stop()
        run["events"] = log_events(log, srv.popen_wall, model.name)
        run["shm_left"] = [s["name"] for s in shm_segments(model.name)]
        run["load_avg"] = loadavg()
        self.runs.append(run)
        ev = run["events"]
        inst = ev["instance_ready"]
        print(
            f"  {model.name:10s} {label:28s} n={count} prefault={'on ' if prefault else 'off'} "
            f"ready {run['ready_s']:7.2f} s  (first log {_f(ev['first_log'])}, instances ready "
            f"{_f(min(inst) if inst else None)}..{_f(max(inst) if inst else None)}, "
            f"loaded {_f(ev['loaded'])}) "
            f"lookup {run['first_lookup_s'] * 1e3:.1f} ms correct={run['correct']}"
            + (
                f"  PSS {run['mem']['Pss'] / 2**30:.2f} GiB RSS {run['mem']['Rss'] / 2**30:.2f} GiB"
                if memory
                else ""
            ),
            flush=True,
        )
        if not run["correct"]:
            raise SystemExit(f"WRONG ANSWER from {model.name} ({label}); log: {log}")
        if run["shm_left"]:
            print(f"  WARNING: left in /dev/shm: {run['shm_left']}")
        return run

    def layout_of(self, model: Model) -> str:
        return node_store.ensure_layout(str(model.table_dir), model.dim, str(self.store)).path

    def in_process_breakdown(self, model: Model) -> dict:
        """A fresh Python process: import time, map time (store fast path), prefault time."""
        code = (
            "import time, json; t0 = time.perf_counter()\n"
            "from triton_rec.serving.deployment import open_session\n"
            "from triton_rec.storage import node_store\n"
            "from triton_rec.config.ps_json import TableParams\n"
            "t1 = time.perf_counter()\n"
            f"tp = TableParams(name='emb', sparse_file={str(model.table_dir)!r},"
            f" vec_size={model.dim}, max_keys_per_sample=1, default_value=-1.0)\n"
            f"t = node_store.load_table(tp, {str(self.store)!r})\n"
            "t2 = time.perf_counter()\n"
            "t.prefault()\n"
            "t3 = time.perf_counter()\n"
            "print(json.dumps({'import_s': t1 - t0, 'map_s': t2 - t1, 'prefault_s': t3 - t2}))\n"
        )
        try:
            out = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                check=True,
                cwd=str(Path(__file__).resolve().parents[1]),
            )
            return json.loads(out.stdout.strip().splitlines()[-1])
        except (subprocess.CalledProcessError, ValueError) as e:
            return {"error": str(getattr(e, "stderr", e))[-500:]}


def _f(x):
    return "-" if x is None else f"{x:.2f}"


def stats(values):
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


# -- report -------------------------------------------------------------------------------


def gib(b):
    return b / 2**30


def report(bench: Bench, models: dict, info: dict, extra: dict) -> str:
    L = []
    L.append("Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    L.append(f"Load average at start / end: {extra['load_start']} / {extra['load_end']}")
    L.append("")
    L.append(
        "| table | rows x dim | table bytes (keys+vectors) | layout file | write s "
        "| cache segment (/dev/shm) |"
    )
    L.append("|---|---|---:|---:|---:|---:|")
    for m in models.values():
        lay = extra["layout"][m.name]
        seg = next((r["shm"] for r in bench.runs if r["model"] == m.name and r.get("shm")), [])
        segtxt = (
            ", ".join(
                f"{s['size'] / 2**20:.1f} MiB ({s['allocated'] / 2**20:.1f} MiB allocated)"
                for s in seg
            )
            or "-"
        )
        L.append(
            f"| {m.name} | {m.rows:,} x {m.dim} "
            f"| {gib(m.table_bytes):.2f} GiB ({m.table_bytes / 1e9:.2f} GB) "
            f"| {gib(lay['bytes']):.2f} GiB | {m.write_seconds:.1f} | {segtxt} |"
        )
    L.append("")
    L.append(
        "Start-to-ready (Popen of tritonserver -> /v2/health/ready 200). "
        "Log columns (medians): seconds after Popen of the server log's first line, "
        'of the first "TRITONBACKEND_ModelInstanceInitialize" (the model-level part, '
        "incl. the Python backend's auto-complete stub, is over), of the instances' "
        '"hps model ... ready" lines (first..last), of "successfully loaded".'
    )
    L.append("")
    L.append(
        "| table | run | instances | prefault | page cache | start-to-ready s (median, min-max, n) "
        "| first log | instance init starts | instance(s) ready | loaded | 1st lookup ms |"
    )
    L.append("|---|---|---:|---|---|---|---:|---:|---|---:|---:|")
    groups = {}
    for r in bench.runs:
        groups.setdefault(
            (r["model"], r["label"], r["count"], r["prefault"], r["cache"]), []
        ).append(r)
    for (model, label, count, prefault, cache), rs in groups.items():
        s = stats([r["ready_s"] for r in rs])
        t = f"{s['median']:.2f}" + (
            f" ({s['min']:.2f}-{s['max']:.2f}, n={s['n']})" if s["n"] > 1 else ""
        )
        ev = [r["events"] for r in rs]
        fl = statistics.median(
            [e["first_log"] for e in ev if e["first_log"] is not None] or [float("nan")]
        )
        ir = [e["instance_ready"] for e in ev if e["instance_ready"]]
        irt = (
            f"{statistics.median(min(x) for x in ir):.2f}.."
            f"{statistics.median(max(x) for x in ir):.2f}"
            if ir
            else "-"
        )
        ii = statistics.median(
            [min(e["instance_init"]) for e in ev if e["instance_init"]] or [float("nan")]
        )
        ld = statistics.median(
            [e["loaded"] for e in ev if e["loaded"] is not None] or [float("nan")]
        )
        lk = statistics.median([r["first_lookup_s"] * 1e3 for r in rs])
        L.append(
            f"| {model} | {label} | {count} | {'on' if prefault else 'off'} | {cache} "
            f"| {t} | {fl:.2f} | {ii:.2f} | {irt} | {ld:.2f} | {lk:.1f} |"
        )
    L.append("")
    if extra.get("breakdown"):
        L.append(
            "In-process breakdown of an instance's load (fresh Python process, "
            "layout in the page cache, no Triton): import of triton_rec, "
            "store fast path + map (`load_table`), `prefault()`."
        )
        L.append("")
        L.append("| table | import s | map s | prefault s |")
        L.append("|---|---:|---:|---:|")
        for name, b in extra["breakdown"].items():
            if "error" in b:
                L.append(f"| {name} | error: {b['error']!r} | | |")
            else:
                L.append(
                    f"| {name} | {b['import_s']:.3f} | {b['map_s']:.3f} | {b['prefault_s']:.3f} |"
                )
        L.append("")
    mem = [r for r in bench.runs if "mem" in r]
    if mem:
        big = models[mem[0]["model"]]
        lay = extra["layout"][big.name]["bytes"]
        L.append(
            f"Memory of the instance processes after one lookup ({big.name}: table "
            f"{gib(big.table_bytes):.2f} GiB, layout file incl. hash index {gib(lay):.2f} GiB). "
            "Naive = N private copies of the layout (interpreter overhead not included)."
        )
        L.append("")
        L.append(
            "| instances | total PSS GiB | PSS file / anon / shmem GiB | total RSS GiB "
            "| naive N x layout GiB | PSS / layout | PSS - 1 layout, per instance MiB "
            "| start-to-ready s |"
        )
        L.append("|---:|---:|---|---:|---:|---:|---:|---:|")
        for r in mem:
            m = r["mem"]
            L.append(
                f"| {r['count']} | {gib(m['Pss']):.2f} "
                f"| {gib(m['Pss_File']):.2f} / {gib(m['Pss_Anon']):.2f} / "
                f"{gib(m['Pss_Shmem']):.2f} | {gib(m['Rss']):.2f} | {gib(r['count'] * lay):.2f} "
                f"| {m['Pss'] / lay:.2f} | {(m['Pss'] - lay) / r['count'] / 2**20:.0f} "
                f"| {r['ready_s']:.2f} |"
            )
        L.append("")
    left = sorted({s for r in bench.runs for s in r["shm_left"]}) or "nothing"
    L.append(
        f"Every server answered a lookup of 64 random known keys with the exact vectors written: "
        f"{all(r['correct'] for r in bench.runs)} ({len(bench.runs)} servers). "
        f"Left in /dev/shm after stop: {left}."
    )
    return "\n".join(L)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--rows", type=int, default=4_100_000, help="rows of the big table (default 4.1M)"
    )
    p.add_argument("--dim", type=int, default=256, help="floats per vector (default 256: 4.2 GB)")
    p.add_argument(
        "--small-rows", type=int, default=245_000, help="rows of the small table (0: skip)"
    )
    p.add_argument("--instances", default="1,2,4", help="instance counts for the memory runs")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each warm second load")
    p.add_argument("--gpucacheper", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--dir", default=tempfile.gettempdir(), help="where the work directory is created"
    )
    p.add_argument(
        "--log-dir", help="keep the server logs here (default: inside the work directory)"
    )
    p.add_argument("--no-cold", action="store_true", help="skip the cold page cache runs")
    p.add_argument(
        "--first-load-warm",
        action="store_true",
        help="do not evict the source from the page cache before the first load",
    )
    p.add_argument(
        "--timeout", type=float, default=900.0, help="seconds to wait for a server to be ready"
    )
    p.add_argument("--poll", type=float, default=0.02, help="seconds between readiness polls")
    p.add_argument(
        "--keep", action="store_true", help="keep the work directory (tables, store, logs)"
    )
    p.add_argument("--json", help="write every measurement here")
    a = p.parse_args(argv)
    counts = [int(c) for c in a.instances.split(",") if c]
    work = Path(tempfile.mkdtemp(prefix="trec-bench-server-", dir=a.dir))
    info = machine_info(str(work))
    extra = {"load_start": loadavg(), "layout": {}, "breakdown": {}}
    print("machine:", json.dumps(info), flush=True)
    print("work directory:", work, flush=True)
    cold_ok = can_drop_caches() and not a.no_cold
    if not a.no_cold and not cold_ok:
        print("not root or /proc/sys/vm/drop_caches not writable: the drop_caches runs are skipped")
    bench = Bench(a, work)
    models = {}
    t_all = time.perf_counter()
    try:
        specs = [("hps_big", a.rows)] + ([("hps_small", a.small_rows)] if a.small_rows else [])
        for name, rows in specs:
            print(f"writing {name}: {rows:,} x {a.dim} ...", flush=True)
            m = models[name] = Model(work, name, rows, a.dim, a.seed + len(models), a.gpucacheper)
            print(f"  {m.write_seconds:.1f} s, {m.table_bytes / 1e9:.2f} GB", flush=True)
        for name, m in models.items():
            # (a) first load: the store is empty, the backend converts the table.
            if not a.first_load_warm:
                evict_files(*m.source_files())
            cache = "source cached" if a.first_load_warm else "source evicted"
            frac = cached_fraction(str(m.table_dir / VECTOR_FILE))
            print(
                f"{name}: source vectors {frac:.0%} in the page cache before the first load",
                flush=True,
            )
            bench.serve(m, "first load (convert)", 1, True, cache)
            lay = bench.layout_of(m)
            extra["layout"][name] = {"path": lay, "bytes": os.path.getsize(lay)}
            # (b) second loads, layout in the page cache.
            for _ in range(a.reps):
                bench.serve(m, "second load", 1, True, "warm")
            for _ in range(a.reps):
                bench.serve(m, "second load", 1, False, "warm")
            # The Python backend starts (and stops) one extra stub process per model to ask
            # it for an auto-completed config; the hps backend completes nothing.
            for _ in range(a.reps):
                bench.serve(
                    m,
                    "second load, " + NO_AUTOCOMPLETE,
                    1,
                    True,
                    "warm",
                    extra_args=[NO_AUTOCOMPLETE],
                )
            extra["breakdown"][name] = bench.in_process_breakdown(m)
            print(f"  in-process breakdown: {extra['breakdown'][name]}", flush=True)
            if name != "hps_big" or a.no_cold:
                continue
            evict_files(lay)
            print(f"  layout {cached_fraction(lay):.0%} cached after fadvise(DONTNEED)", flush=True)
            bench.serve(m, "second load", 1, True, "layout evicted")
            if cold_ok:
                for prefault in (True, False):
                    s = drop_caches()
                    print(
                        f"  drop_caches took {s:.1f} s; layout {cached_fraction(lay):.0%} cached",
                        flush=True,
                    )
                    bench.serve(m, "second load", 1, prefault, "drop_caches")
            # memory: with the layout back in the page cache (the last run did not read it all).
            print(
                f"  re-reading the layout: {warm_file(lay):.1f} s; "
                f"{cached_fraction(lay):.0%} cached",
                flush=True,
            )
            for c in counts:
                bench.serve(m, "second load, memory", c, True, "warm", memory=True)
        if "hps_big" in models and a.no_cold:
            for c in counts:
                bench.serve(models["hps_big"], "second load, memory", c, True, "warm", memory=True)
    finally:
        extra["load_end"] = loadavg()
        extra["total_s"] = time.perf_counter() - t_all
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
            print(f"deleted {work}")
        else:
            print(f"kept {work}")
    text = report(bench, models, info, extra)
    print()
    print(text)
    print(f"\ntotal {extra['total_s']:.0f} s")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {"machine": info, "args": vars(a), "extra": extra, "runs": bench.runs},
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
