# Type stub of the C++ extension (src/native/bindings.cpp), for mypy: every attribute is
# untyped (Any). The real signatures and docs are in the module (help(triton_rec._native)).
from typing import Any

def __getattr__(name: str) -> Any: ...
