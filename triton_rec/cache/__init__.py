"""Embedding caches in front of a backing store: the shared-memory CPU cache
(:mod:`.shm_cache`, :mod:`.shm_security`), the numpy/CuPy device cache (:mod:`.array_cache`,
shared over CUDA IPC by :mod:`.gpu_share`) and the cache-over-store logic (:mod:`.cached_table`)."""
