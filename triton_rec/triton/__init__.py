"""Everything that knows about Triton: the backends' shared glue (:mod:`.glue`), custom
metrics (:mod:`.metrics`), instance process set-up (:mod:`.process_setup`), the server
launcher (:mod:`.runtime`), its supervisor (:mod:`.supervisor`) and perf_analyzer."""
