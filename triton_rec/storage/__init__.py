"""Where embedding vectors live: the in-memory table (:mod:`.table`), the backing-store
interface (:mod:`.backing_store`), the node-local store (:mod:`.node_store`), the Redis
and RocksDB tiers and the tier chain (:mod:`.tiers`)."""
