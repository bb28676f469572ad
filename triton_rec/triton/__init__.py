"""Everything that knows about Triton: the backends' shared life cycle
(:mod:`.model_scaffold`), request loop (:mod:`.request_loop`) and load-time set-up
(:mod:`.instance`, :mod:`.process_setup`), custom metrics (:mod:`.metrics`), the native
backend's in-process ``pb_utils`` (:mod:`.inprocess`), the drained stop (:mod:`.drain`),
the server launcher (:mod:`.runtime`), its supervisor (:mod:`.supervisor`) and
perf_analyzer."""
