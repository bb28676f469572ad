"""The trainer side: :class:`UpdateProducer` appends update messages to the streams."""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from triton_rec.storage.backing_store import chunks
from triton_rec.updates.codec import check_update_rows, encode_message, topic_name
from triton_rec.updates.transport import FIELD, StreamConnection

#: most bytes of messages sent in one pipeline by :meth:`UpdateProducer.publish`
PIPELINE_BYTES = 16 << 20


class UpdateProducer:
    """Publishes updates (the trainer side) to the streams of a Redis Cluster.

    Args:
        address: ``host:port[,host:port...]`` of the Redis Cluster.
        user_name, password: ACL credentials (sent only with a password).
        maxlen: keep about this many entries per stream (``XADD MAXLEN ~``; None: all).
            Trimmed entries that a consumer group has not read yet are lost to it.
        max_batch_size: most key/value pairs per message (a larger batch becomes
            several messages).
        **kwargs: the other connection settings of
            :class:`~triton_rec.storage.redis_store.RedisClusterStore` (TLS, timeouts, retries).

    Raises:
        ConfigError: a malformed address. StoreUnavailableError: the cluster cannot be
            reached.

    Thread-safety: :meth:`publish` may be called from several threads.
    """

    def __init__(
        self,
        address: str,
        user_name: Optional[str] = None,
        password: Optional[str] = None,
        maxlen: Optional[int] = None,
        max_batch_size: int = 8192,
        **kwargs,
    ):
        if int(max_batch_size) < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if maxlen is not None and int(maxlen) < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self.maxlen = None if maxlen is None else int(maxlen)
        self.max_batch_size = int(max_batch_size)
        self._redis = StreamConnection(address, user_name=user_name, password=password, **kwargs)

    def publish(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Append the rows to the stream ``hps_et.<model>.<table>``, one entry per
        ``max_batch_size`` rows (in order); returns the number of entries (messages).

        ``keys``: 1-D integers (int64 range); ``vectors``: ``[M, D]`` floats (sent as
        float32). Raises ValueError for other shapes or dtypes, ConfigError for bad
        names, StoreError if Redis fails (entries sent before the failure stay).
        """
        topic = topic_name(model, table).encode()
        keys, vectors = check_update_rows(keys, vectors)
        sent = 0
        group: List[bytes] = []
        group_bytes = 0
        for s, e in chunks(keys.shape[0], self.max_batch_size):
            # encode chunk by chunk: a large table (e.g. a memory-mapped sparse file) is
            # never copied whole
            m = encode_message(
                keys[s:e].astype(np.int64, copy=False),
                np.ascontiguousarray(vectors[s:e], dtype=np.float32),
            )
            group.append(m)
            group_bytes += len(m)
            if group_bytes >= PIPELINE_BYTES:
                sent += self._send(topic, group)
                group, group_bytes = [], 0
        if group:
            sent += self._send(topic, group)
        return sent

    def _send(self, topic: bytes, messages: List[bytes]) -> int:
        def commands(pipe):
            for m in messages:
                pipe.xadd(
                    topic, {FIELD: m}, maxlen=self.maxlen, approximate=self.maxlen is not None
                )

        self._redis.run("XADD", commands)
        return len(messages)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        self._redis.close()

    def __enter__(self) -> UpdateProducer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
