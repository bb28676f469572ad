"""The parts of :mod:`triton_rec.dense.hugectr_network`, one concern each.

- :mod:`.plan`: the checked network without its weights (:class:`~.plan.NetworkPlan`,
  :class:`~.plan.LayerPlan`, :class:`~.plan.ParamBlock`) and per-sample shapes;
- :mod:`.layers`: every supported layer type: its static checks, parameters and forward;
- :mod:`.parse`: the network JSON -> a :class:`~.plan.NetworkPlan` (the graph's rules);
- :mod:`.weights`: the dense file and the BatchNorm statistics file;
- :mod:`.native_program`: the network as the native executor's program.

:mod:`triton_rec.dense.hugectr_network` holds the model (``HugeCTRNetwork``) and re-exports
the public names of these modules; import from there.
"""
