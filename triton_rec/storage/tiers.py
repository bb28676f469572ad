"""The storage hierarchy behind an embedding cache: volatile tier -> persistent tier -> default.

HPS looks up what its embedding cache misses in the volatile database (a node-local
hash map or a Redis Cluster shared by every node), then in the persistent database
(RocksDB on local disk), and answers what neither holds with the table's default
value. :class:`TieredStore` is that chain, behind the same
:class:`~triton_rec.storage.backing_store.BackingStore` interface the cache already uses:

- ``fetch``: each tier is asked only for the keys the tiers before it did not hold;
  with ``cache_missed_embeddings`` the rows a later tier found are copied into the
  first one (best effort: a failed copy is logged, the answer is still right);
- a tier that cannot be reached (:class:`~triton_rec.storage.backing_store.StoreUnavailableError`)
  either fails the lookup (``on_unavailable: "fail"``, the default: the request gets an
  error naming the tier) or is skipped (``"next_tier"``);
- ``upsert``/``delete`` go to every writable tier; :meth:`TieredStore.apply_update`
  (online updates) only to the tiers whose ``update_filters`` match the topic.

:func:`import_table` is the initial import of a table's sparse files into a writable
tier, done once per content: a marker (the content digest) is stored beside the table
and checked under the tier's import lock, so every other process and node skips it.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from triton_rec.storage.backing_store import (
    BackingStore,
    StoreError,
    StoreUnavailableError,
    check_keys,
)
from triton_rec.util.log_throttle import LogThrottle

log = logging.getLogger(__name__)

#: name of the marker holding the content digest of the imported sparse files
SOURCE_META = "source_digest"


@dataclass
class Tier:
    r"""One store of the chain.

    Args:
        role: ``"local"``, ``"volatile"`` or ``"persistent"`` (messages, metrics).
        store: the store.
        on_unavailable: ``"fail"`` or ``"next_tier"``.
        update_filters: regexes; an online update of topic ``hps_et.<model>.<table>``
            is written to this tier if one of them matches either the whole topic, or
            the model name the way HPS subscribes (filter ``f`` becomes
            ``^hps_et\.<f>\..+$``, so ``["dlrm"]`` takes the updates of model
            ``dlrm`` and ``[".+"]`` those of every model). HPS's default
            ``["^hps_.+$"]`` matches every topic as a whole-topic filter.
    """

    role: str
    store: BackingStore
    on_unavailable: str = "fail"
    update_filters: Tuple[str, ...] = (".+",)
    _filters: List[re.Pattern] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if self.on_unavailable not in ("fail", "next_tier"):
            raise ValueError(
                f"on_unavailable must be 'fail' or 'next_tier', got {self.on_unavailable!r}"
            )
        self._filters = []
        for f in self.update_filters:
            # a filter of the whole topic, and HPS's subscription built from it
            self._filters.append(re.compile(f))
            try:
                self._filters.append(re.compile(r"hps_et\.(?:" + f + r")\.[^.]+"))
            except re.error:  # e.g. global flags, which must open a pattern
                pass

    def accepts(self, topic: Optional[str]) -> bool:
        """Whether online updates of ``topic`` are written to this tier."""
        if self.store.read_only:
            return False
        return topic is None or any(f.fullmatch(topic) for f in self._filters)


class TieredStore(BackingStore):
    """Several stores asked in order; see the module docstring.

    Args:
        name: the table (messages).
        tiers: the chain, first asked first. All must have the same ``vec_size`` and
            ``default_value``.
        cache_missed_embeddings: copy rows found in a later tier into the first.

    Thread-safety: every method may be called from any number of threads (the tiers
    are thread-safe; the counters take a lock).
    """

    tier = "tiered"

    def __init__(self, name: str, tiers: Sequence[Tier], cache_missed_embeddings: bool = False):
        if not tiers:
            raise ValueError(f"table {name!r}: a tiered store needs at least one tier")
        first = tiers[0].store
        for t in tiers[1:]:
            if (t.store.codec, t.store.default_value) != (first.codec, first.default_value):
                raise ValueError(
                    f"table {name!r}: tiers disagree on vec_size/precision/default_value"
                )
        self.name = name
        self._codec = first.codec
        self.tiers = list(tiers)
        self.vec_size = first.vec_size
        self.default_value = first.default_value
        self.read_only = all(t.store.read_only for t in self.tiers)
        self.exact_num_rows = self.tiers[-1].store.exact_num_rows
        self.cache_missed_embeddings = bool(cache_missed_embeddings) and not first.read_only
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = {}
        self._throttle = LogThrottle()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] = self._counts.get(k, 0) + v

    def counters(self) -> Dict[str, int]:
        """Monotonic counters: ``<role>_found``, ``<role>_unavailable``, ``promoted``,
        ``promote_failed``, ``not_found`` (answered with the default value)."""
        with self._lock:
            return dict(self._counts)

    # -- reading --------------------------------------------------------------------

    def fetch(self, keys: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Each key from the first tier that holds it (an unavailable tier skipped or fatal)."""
        keys = check_keys(keys)
        m = keys.shape[0]
        found = np.zeros(m, dtype=bool)
        if m == 0:
            return found
        pending = np.arange(m)  # indices of keys no tier has answered yet
        for i, tier in enumerate(self.tiers):
            sub_keys = keys if i == 0 else keys[pending]
            buf = out if i == 0 else np.empty((pending.shape[0],) + out.shape[1:], out.dtype)
            try:
                hit = tier.store.fetch(sub_keys, buf)
            except StoreUnavailableError as e:
                self._count(**{f"{tier.role}_unavailable": 1})
                if tier.on_unavailable == "fail":
                    raise
                allowed, held = self._throttle.allow()
                if allowed:
                    log.warning(
                        "table %s: %s tier skipped (%d more since the last line): %s",
                        self.name,
                        tier.role,
                        held,
                        e,
                    )
                continue
            if i > 0:
                out[pending[hit]] = buf[hit]
                if self.cache_missed_embeddings and hit.any():
                    self._promote(sub_keys[hit], buf[hit])
            found[pending[hit]] = True
            self._count(**{f"{tier.role}_found": int(hit.sum())})
            pending = pending[~hit]
            if pending.shape[0] == 0:
                break
        if pending.shape[0]:
            rows = out.dtype != np.float32 and self.codec.is_rows(out)
            out[pending] = (
                self.codec.default_row(self.default_value) if rows else self.default_value
            )
            self._count(not_found=int(pending.shape[0]))
        return found

    def _promote(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        try:
            self.tiers[0].store.upsert(keys, np.ascontiguousarray(vectors))
            self._count(promoted=int(keys.shape[0]))
        except StoreError as e:
            self._count(promote_failed=int(keys.shape[0]))
            allowed, held = self._throttle.allow()
            if allowed:
                log.warning(
                    "table %s: copying %d row(s) into the %s tier failed (%d more "
                    "failures since the last line): %s",
                    self.name,
                    keys.shape[0],
                    self.tiers[0].role,
                    held,
                    e,
                )

    def num_rows(self) -> int:
        """Rows of the last tier (the one that holds every row)."""
        return self.tiers[-1].store.num_rows()

    def sample_keys(self, n: int) -> np.ndarray:
        """Keys of the first tier that holds any (the hottest rows live in front)."""
        for t in self.tiers:
            try:
                keys = t.store.sample_keys(n)
            except StoreUnavailableError:
                if t.on_unavailable == "fail":
                    raise
                continue
            if keys.shape[0]:
                return keys
        return np.empty(0, dtype=np.int64)

    # -- writing --------------------------------------------------------------------

    def upsert(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Write to every writable tier, last (the source of truth) first."""
        return self.apply_update(keys, vectors, topic=None)

    def apply_update(self, keys: np.ndarray, vectors: np.ndarray, topic: Optional[str]) -> int:
        """Write an online update of ``topic`` to the tiers whose filters accept it, the
        last tier first (so a row is never in front without being behind). Returns the
        number of distinct keys written (0 if no tier accepts the topic)."""
        if self.read_only:
            return super().upsert(keys, vectors)
        written = 0
        for t in reversed(self.tiers):
            if t.accepts(topic):
                written = t.store.upsert(keys, vectors)
        return written

    def delete(self, keys: np.ndarray) -> int:
        """Remove ``keys`` from every writable tier; returns the most any tier held."""
        if self.read_only:
            return super().delete(keys)
        held = 0
        for t in self.tiers:
            if not t.store.read_only:
                held = max(held, t.store.delete(keys))
        return held

    def close(self) -> None:
        """Close every tier."""
        for t in self.tiers:
            t.store.close()

    def __repr__(self) -> str:
        return f"TieredStore({self.name!r}, {' -> '.join(repr(t.store) for t in self.tiers)})"


def import_table(
    store: BackingStore,
    keys: np.ndarray,
    vectors: np.ndarray,
    digest: str,
    fraction: float = 1.0,
    freeze: bool = False,
    batch: int = 65536,
    lock_timeout: float = 600.0,
    progress: Optional[Callable[[int, int], None]] = None,
    marker: str = SOURCE_META,
    sibling_markers: Sequence[str] = (),
) -> str:
    """Import a table's rows into a writable tier once per content.

    Args:
        store: the tier.
        keys, vectors: the rows (e.g. of the node-local layout of the sparse files).
        digest: content digest of the rows; stored as the marker when the import is done.
        fraction: import the first ``ceil(fraction * rows)`` rows (HPS
            ``initial_cache_rate`` of a volatile tier backed by a persistent one).
        freeze: ``freeze_sparse``: a tier that holds rows keeps them (no re-import when
            the files changed; online updates stay; a tier HPS filled is served as is).
        batch: rows per upsert.
        lock_timeout: seconds to wait for another importer of the same table.
        progress: ``progress(done, total)`` after every batch.
        marker: the metadata field holding the digest. Tables fused into one tier table
            (HPS's ``fuse_embedding_table``) each import their own rows under their own
            marker; ``sibling_markers`` are the other members' (with ``freeze``, rows in the
            table count as "HPS filled it" only while no member has a marker).

    Returns:
        ``"present"`` (marker equal: skipped), ``"frozen"`` (skipped by ``freeze``) or
        ``"imported"``.
    """

    def skip() -> Optional[str]:
        have = store.get_meta(marker)
        if have == digest:
            return "present"
        # freeze keeps what the tier holds: our import, or rows put there by others
        # (e.g. a database HPS filled, which has no marker)
        if freeze and (
            have is not None
            or (store.num_rows() > 0 and all(store.get_meta(m) is None for m in sibling_markers))
        ):
            return "frozen"
        return None

    result = skip()
    if result:
        return result
    with store.import_lock(lock_timeout):
        result = skip()  # another process may have done it while we waited
        if result:
            return result
        n = keys.shape[0] if fraction >= 1.0 else int(math.ceil(fraction * keys.shape[0]))
        t0 = time.monotonic()
        for s in range(0, n, batch):
            e = min(n, s + batch)
            store.upsert(  # float32 vectors, or rows in the store's precision
                np.ascontiguousarray(keys[s:e], dtype=np.int64),
                np.ascontiguousarray(vectors[s:e]),
            )
            if progress is not None:
                progress(e, n)
        compact = getattr(store, "compact", None)
        if compact is not None:  # RocksDB: one sorted run instead of a file per batch
            compact()
        store.set_meta(marker, digest)
        log.info("%r: imported %d row(s) in %.1f s", store, n, time.monotonic() - t0)
        return "imported"
