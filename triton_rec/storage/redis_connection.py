"""A connection to a Redis Cluster with the project's settings (timeouts, retries, pool,
TLS, ACL) and error translation: the one way both the Redis tier
(:mod:`triton_rec.storage.redis_store`) and the update transport talk to Redis."""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Tuple

from triton_rec.errors import ConfigError
from triton_rec.storage.backing_store import (
    StoreError,
    StoreUnavailableError,
)

try:  # optional dependency (pip install redis)
    import redis
    from redis.backoff import ConstantBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.connection import BlockingConnectionPool, SSLConnection
    from redis.exceptions import (
        AskError,
        ClusterDownError,
        ClusterError,
        MovedError,
        RedisClusterException,
        RedisError,
        TryAgainError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.retry import Retry
except ImportError as _e:  # pragma: no cover - exercised only without redis-py
    redis = None  # type: ignore[assignment]  # optional module: None when absent
    _IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

log = logging.getLogger("triton_rec.storage.redis_store")  # the Redis tier's log


def parse_address(address: str) -> List[Tuple[str, int]]:
    """``"host:port,host:port"`` (``[v6]:port`` for IPv6) as ``[(host, port), ...]``.

    Raises:
        ConfigError: empty, or an entry without a valid port.
    """
    nodes = []
    for part in (address or "").split(","):
        part = part.strip()
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"Redis address {address!r}: {part!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ConfigError(f"Redis address {address!r}: no host:port given")
    return nodes


def _pipeline_stack(pipe):
    """The queued commands of a cluster pipeline (redis-py 6+: its execution strategy's
    ``command_queue``; 5: ``command_stack``), or None if this redis-py has neither."""
    strategy = getattr(pipe, "_execution_strategy", None)
    if strategy is not None:
        return getattr(strategy, "command_queue", None)
    return getattr(pipe, "command_stack", None)


def _tls_connection_class(server_name: Optional[str]):
    """An SSLConnection that sends ``server_name`` as SNI and checks the certificate
    against it (redis-py uses the address it connects to for both)."""
    if server_name is None:
        return SSLConnection
    if not hasattr(SSLConnection, "_wrap_socket_with_ssl"):  # pragma: no cover - old redis-py
        raise ConfigError("tls_server_name_identification needs redis-py >= 5")

    class _SNIConnection(SSLConnection):
        def _wrap_socket_with_ssl(self, sock):
            host = self.host
            self.host = server_name
            try:
                return super()._wrap_socket_with_ssl(sock)
            finally:
                self.host = host

    return _SNIConnection


class RedisConnection:
    """A connection to a Redis Cluster with the project's settings (timeouts, retries,
    pool, TLS, ACL) and error translation: the one way both the Redis tier
    (:class:`RedisClusterStore`) and the update streams (:mod:`triton_rec.updates`) connect.

    Args:
        address: ``"host:port,host:port"``: some masters of the cluster (the others are
            discovered).
        user_name, password: ACL credentials; sent only when ``password`` is set (HPS's
            default user name ``"default"`` with an empty password means no AUTH).
        enable_tls, tls_ca_certificate (file or directory), tls_client_certificate,
            tls_client_key, tls_server_name_identification: TLS as in HPS. The server
            certificate is verified, and its name checked against
            ``tls_server_name_identification`` if given, else against the address.
        num_node_connections: connections per master (a request waits at most
            ``pool_timeout`` for a free one).
        connect_timeout, socket_timeout: seconds, per connection attempt / per reply.
        retries: whole-pipeline retries after a connection error or timeout. A call to
            a stalled master fails after about ``(retries + 1) x socket_timeout`` plus
            one topology refresh (measured: 1.5 s with 0.5 s and 1 retry); a refused
            connection (master down) fails at once.
        pool_timeout: seconds to wait for a free connection.
        where: how error messages name what failed (default ``"Redis Cluster <address>"``).

    Attributes:
        client: the redis-py ``RedisCluster``.

    Raises:
        StoreUnavailableError: redis-py is missing, or the cluster cannot be reached
            (names ``address``).
        ConfigError: a malformed ``address``. ValueError: ``num_node_connections < 1``.

    Thread-safety: every method may be called from any number of threads.
    """

    def __init__(
        self,
        address: str,
        user_name: Optional[str] = None,
        password: Optional[str] = None,
        enable_tls: bool = False,
        tls_ca_certificate: Optional[str] = None,
        tls_client_certificate: Optional[str] = None,
        tls_client_key: Optional[str] = None,
        tls_server_name_identification: Optional[str] = None,
        num_node_connections: int = 5,
        connect_timeout: float = 2.0,
        socket_timeout: float = 2.0,
        retries: int = 2,
        pool_timeout: float = 5.0,
        where: Optional[str] = None,
    ):
        if redis is None:
            raise StoreUnavailableError(
                f"Redis store: the redis package cannot be imported ({_IMPORT_ERROR}; "
                "pip install redis)"
            )
        if int(num_node_connections) < 1:
            raise ValueError(f"num_node_connections must be >= 1, got {num_node_connections}")
        self.address = address
        self._where = where if where is not None else f"Redis Cluster {address}"
        nodes = parse_address(address)

        kwargs: Dict[str, Any] = dict(
            socket_connect_timeout=float(connect_timeout),
            socket_timeout=float(socket_timeout),
            max_connections=int(num_node_connections),
            connection_pool_class=BlockingConnectionPool,
            timeout=float(pool_timeout),  # BlockingConnectionPool: wait for a free connection
            retry=Retry(ConstantBackoff(0.05), int(retries)),
            require_full_coverage=True,
            decode_responses=False,
        )
        if password:
            kwargs.update(username=user_name or None, password=password)
        if enable_tls:
            # "redis://" + our connection class (not "rediss://", whose parsing would
            # replace the class and so lose the SNI setting).
            kwargs.update(
                connection_class=_tls_connection_class(tls_server_name_identification),
                ssl_cert_reqs="required",
                ssl_check_hostname=True,
                ssl_certfile=tls_client_certificate,
                ssl_keyfile=tls_client_key,
            )
            if tls_ca_certificate and os.path.isdir(tls_ca_certificate):
                kwargs["ssl_ca_path"] = tls_ca_certificate
            elif tls_ca_certificate:
                kwargs["ssl_ca_certs"] = tls_ca_certificate
        host0, port0 = nodes[0]
        url_host = f"[{host0}]" if ":" in host0 else host0
        try:
            # The URL form is the one in which redis-py honours connection_pool_class.
            self.client = RedisCluster(
                url=f"redis://{url_host}:{port0}",
                startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]],
                **kwargs,
            )
        except (RedisError, RedisClusterException, OSError) as e:
            raise StoreUnavailableError(f"Redis Cluster {address}: cannot connect: {e}") from e
        self._closed = False

    def run_commands(self, what: str, commands) -> list:
        """Pipeline ``commands(pipe)`` (a redis-py cluster pipeline) and return the
        replies, with this connection's timeouts and retries; redis errors become
        :class:`StoreUnavailableError` / :class:`StoreError` naming ``where``."""
        if self._closed:
            raise StoreError(f"{self._where}: store is closed")
        try:
            pipe = self.client.pipeline(transaction=False)
            commands(pipe)
            stack = _pipeline_stack(pipe)
            if stack is None:  # pragma: no cover - a redis-py without the hook: slower failures
                return pipe.execute()
            try:
                # No redirections: redis-py would otherwise re-send every failed command
                # of the pipeline alone, each with its own retries and timeouts, so a
                # stalled master would cost (commands x retries x socket_timeout).
                # Connection errors and timeouts still get `retries` whole-pipeline retries.
                return pipe.send_cluster_commands(
                    stack, raise_on_error=True, allow_redirections=False
                )
            except (MovedError, AskError, TryAgainError):
                # Slots moved (resharding): run it again, following redirections (redis-py
                # updates its slot table from the MOVED replies).
                pipe = self.client.pipeline(transaction=False)
                commands(pipe)
                return pipe.execute()
        except (
            RedisConnectionError,
            RedisTimeoutError,
            ClusterDownError,
            TryAgainError,
            RedisClusterException,
            OSError,
        ) as e:
            raise StoreUnavailableError(
                f"{self._where}: {what} failed: {type(e).__name__}: {e}"
            ) from e
        except (ClusterError, RedisError) as e:
            raise StoreError(f"{self._where}: {what} failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        """Close the connection (idempotent); later commands raise StoreError."""
        if self._closed:
            return
        self._closed = True
        try:
            self.client.close()
        except (RedisError, RedisClusterException, OSError):  # pragma: no cover - best effort
            pass
