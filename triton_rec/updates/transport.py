"""The update streams: each topic is a **Redis Stream** of that name in a Redis Cluster.

HPS used Kafka topics; here each topic is a Redis Stream, one entry per message (field
``v``). Consumers read in **consumer groups** (``XREADGROUP``): each inference node uses
its own group, so every node sees every update; one consumer of a group reads a topic at
a time (its lease: :class:`triton_rec.updates.consumer.UpdateConsumer`), so a topic's
entries are applied in order. An entry is acknowledged (``XACK``) only after it was
applied, so delivery is at least once (an update may be applied twice, which upserts make
harmless): a consumer that dies leaves its entries pending and the next holder of the
topic takes them over (``XAUTOCLAIM`` after ``claim_idle_ms``) before it reads newer ones;
a consumer restarted under the same name first re-reads its own pending entries.

Each stream key lives in one hash slot, so a consumer reads its topics one
``XREADGROUP`` per stream (a multi-stream read would be refused with CROSSSLOT).
"""

from __future__ import annotations

import threading
from typing import Optional

from triton_rec.storage.backing_store import StoreError
from triton_rec.storage.redis_store import RedisConnection, parse_address
from triton_rec.updates.codec import topic_name

FIELD = b"v"  # the stream entry field holding the message
#: how errors of the streams name what failed (the text they have always had)
WHERE = "Redis Cluster {address} table 'hps_et.updates'"


def is_response_error(e: BaseException, marker: str) -> bool:
    """Whether a StoreError comes from a Redis error reply holding ``marker``
    (BUSYGROUP, NOGROUP, ...)."""
    from redis.exceptions import ResponseError

    return isinstance(e.__cause__, ResponseError) and marker in str(e)


class StreamConnection:
    """The connection of a producer or consumer to the Redis Cluster of the update
    streams (usually the volatile tier's): a
    :class:`~triton_rec.storage.redis_store.RedisConnection`, the Redis tier's own
    connection (settings, timeouts, TLS, error translation), made on demand.

    Args:
        address: ``host:port[,host:port...]`` of the cluster (a malformed one raises
            ConfigError here).
        connect: connect now. With ``connect=False`` the connection is made by the first
            command (and made again after :meth:`reset`), so an unreachable cluster fails
            commands, not the constructor.
        **kwargs: the settings of :class:`~triton_rec.storage.redis_store.RedisConnection`.

    Thread-safety: every method may be called from any number of threads.
    """

    def __init__(self, address: str, connect: bool = True, **kwargs):
        parse_address(address)  # a malformed address is a ConfigError now, not later
        self.address = address
        self._kwargs = kwargs
        self._conn: Optional[RedisConnection] = None
        self._lock = threading.Lock()
        self._closed = False
        if connect:
            self._get()

    def _get(self) -> RedisConnection:
        with self._lock:
            if self._closed:
                raise StoreError(f"Redis Cluster {self.address}: connection closed")
            if self._conn is not None:
                return self._conn
        # connect outside the lock: close() must not wait for a connect timeout
        conn = RedisConnection(
            self.address, where=WHERE.format(address=self.address), **self._kwargs
        )
        with self._lock:
            if not self._closed and self._conn is None:
                self._conn = conn
                return conn
            current, closed = self._conn, self._closed
        conn.close()  # closed meanwhile, or another thread connected first
        if closed or current is None:
            raise StoreError(f"Redis Cluster {self.address}: connection closed")
        return current

    def run(self, what: str, commands) -> list:
        """Pipeline ``commands(pipe)`` and return the replies
        (:meth:`~triton_rec.storage.redis_store.RedisConnection.run_commands`)."""
        return self._get().run_commands(what, commands)

    def reset(self) -> None:
        """Drop the connection; the next command connects again (fresh slot map)."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close the connection for good (idempotent); later commands raise StoreError."""
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def stream_info(address: str, model: str, table: str, **kwargs) -> dict:
    """``{"topic", "length", "groups": [{"name", "consumers", "pending",
    "last-delivered-id", ..., "members": [{"name", "pending", "idle"}]}]}`` of a topic's
    stream (length 0 and no groups if the stream does not exist). ``members`` lists the
    group's consumers (``idle`` in ms). ``kwargs``: connection settings as for
    :class:`UpdateProducer`."""
    stream = topic_name(model, table).encode()
    r = StreamConnection(address, **kwargs)
    try:
        length = r.run("XLEN", lambda p: p.xlen(stream))[0]
        try:
            groups = r.run("XINFO GROUPS", lambda p: p.xinfo_groups(stream))[0]
        except StoreError as e:
            if "no such key" not in str(e).lower():
                raise
            groups = []
        members = []
        for g in groups:
            members.append(
                r.run("XINFO CONSUMERS", lambda p, g=g: p.xinfo_consumers(stream, g["name"]))[0]
            )
    finally:
        r.close()

    def text(v):
        return v.decode() if isinstance(v, bytes) else v

    return {
        "topic": stream.decode(),
        "length": int(length),
        "groups": [
            {
                **{text(k): text(v) for k, v in g.items()},
                "members": [
                    {"name": text(c["name"]), "pending": int(c["pending"]), "idle": int(c["idle"])}
                    for c in m
                ],
            }
            for g, m in zip(groups, members)
        ],
    }
