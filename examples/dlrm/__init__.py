"""The demo DLRM: PyTorch model, click generator, training loop and exporters
(:mod:`examples.dlrm.torch_dlrm`), used by ``model_repository/dlrm/train.py``, the tests
and the benchmarks. Imports torch; not part of the installed package."""
