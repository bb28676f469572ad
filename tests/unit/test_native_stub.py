"""triton_rec/_native.pyi lists every binding of the extension, and only those: each
module-level name, and each public member of each class (what mypy checks the engine's
calls against)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from triton_rec import _native

STUB = Path(_native.__file__).with_suffix("").parent / "_native.pyi"
if not STUB.exists():  # an editable install keeps the extension in the build tree
    STUB = Path(__file__).parents[2] / "triton_rec" / "_native.pyi"
#: aliases of the stub that are not bindings
STUB_ONLY = {"Array"}


def _stub():
    tree = ast.parse(STUB.read_text())
    names, members = set(), {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            members[node.name] = {
                n.name
                for n in node.body
                if isinstance(n, ast.FunctionDef) and not n.name.startswith("__")
            }
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets)
    return names - STUB_ONLY, members


def test_the_stub_names_every_binding_and_nothing_else():
    names, _ = _stub()
    module = {n for n in dir(_native) if not n.startswith("__")}
    assert sorted(module - names) == [], "bindings missing from _native.pyi"
    assert sorted(names - module) == [], "names in _native.pyi that the module lacks"


def test_the_stub_lists_every_member_of_every_class():
    _, members = _stub()
    for cls, listed in members.items():
        obj = getattr(_native, cls)
        if issubclass(obj, BaseException):
            continue
        public = {n for n in vars(obj) if not n.startswith("__") and n != "_pybind11_conduit_v1_"}
        assert listed == public, f"{cls}: stub {sorted(listed)} vs module {sorted(public)}"
        for n in public:  # a property in the module is one in the stub, and back
            assert isinstance(vars(obj)[n], property) == _is_property(cls, n), f"{cls}.{n}"


def _is_property(cls: str, name: str) -> bool:
    tree = ast.parse(STUB.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def test_inspect_sees_classes_where_the_stub_has_classes():
    _, members = _stub()
    for cls in members:
        assert inspect.isclass(getattr(_native, cls)), cls
