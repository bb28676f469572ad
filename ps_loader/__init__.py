"""ps_loader: offline tools around trained embedding tables (never imported by the engine).

- ``python -m ps_loader``: validate a ps.json, convert its tables to the node-local
  store ahead of serving, write the demo tables (:mod:`ps_loader.__main__`);
- :mod:`ps_loader.synthetic`: the deterministic demo/synthetic tables;
- :mod:`ps_loader.torch_import`: PyTorch state dicts to HugeCTR sparse tables.
- :mod:`ps_loader.criteo`: a generated DLRM of MLPerf's Criteo 1TB shape
  (``python -m ps_loader criteo-dlrm``).

The file formats themselves (readers and writers) are engine code:
:mod:`triton_rec.formats`.
"""
