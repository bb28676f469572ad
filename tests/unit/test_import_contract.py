"""The import contract of the engine: its folder tree is its architecture.

``triton_rec`` is built in layers, innermost first (:data:`LAYERS`, the one place the
order is written down). A module may import its own layer and the layers inside it,
never an outer one; packages that share a layer are independent and may not import each
other. The engine never imports the project's tools or tests (:data:`FORBIDDEN`):
``ps_loader``, the clients and ``benchmarks`` import the engine, not the reverse.

Checked by parsing every module with :mod:`ast` (nothing is imported, so optional
dependencies do not matter), lazy imports inside functions included.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Set, Tuple

import pytest

ENGINE = "triton_rec"
ROOT = Path(__file__).resolve().parents[2]

#: Layers of ``triton_rec``, innermost first; each a set of independent packages
#: (subpackages or modules directly under ``triton_rec``; "" is ``triton_rec/__init__.py``).
LAYERS: Tuple[Set[str], ...] = (
    {"errors"},  # the root of every error the engine raises
    {"", "_native", "util"},  # __init__, the C++ core, small helpers
    {"precision"},  # row encodings (their codes and names: the C++ core's)
    {"gpu"},  # the GPU kernels: NVRTC, compiled and loaded on a device through _native
    {"config"},  # ps.json, config.pbtxt, model files
    {"formats"},  # readers/writers of trained-model files
    {"storage"},  # tables, the node-local store, Redis/RocksDB tiers
    {"cache"},  # shared-memory and device caches in front of a store
    {"updates", "dense"},  # online updates (Redis Streams); dense executors
    {"serving"},  # sessions: requests -> lookups (+ dense) -> answers
    {"triton"},  # Triton glue, metrics, process set-up, the server launcher
    {"runtime"},  # the command line `python -m triton_rec.runtime`
)

#: packages the engine must never import (the clients install as ``triton_rec.clients``
#: from the top-level clients/ folder, so they share the engine's name but not its layers)
FORBIDDEN = ("ps_loader", "triton_rec.clients", "benchmarks", "tests", "examples")
#: what the wheel ships (pyproject ``wheel.packages``, with the :data:`LINKED` folders inside
#: triton_rec); none of it may import ``examples`` (the demo DLRM's training code, which
#: stays in the checkout)
WHEEL_PACKAGES = ("triton_rec", "ps_loader")


def is_forbidden(target: str, forbidden: Sequence[str]) -> str:
    """The entry of ``forbidden`` that the dotted module ``target`` is, or is inside ("")."""
    for f in forbidden:
        if target == f or target.startswith(f + "."):
            return f
    return ""


def module_name(path: Path, package_root: Path) -> str:
    """Dotted name of the module in ``path`` (``pkg/a/__init__.py`` -> ``pkg.a``)."""
    parts = list(path.relative_to(package_root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, name: str, known: Set[str]) -> Iterator[Tuple[int, str]]:
    """``(line, dotted module)`` of every import in a file (relative ones resolved;
    ``from pkg import mod`` gives ``pkg.mod`` when that is a module of ``known``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            targets = {f"{base}.{a.name}" for a in node.names} & known or {base}
            for target in sorted(targets):
                yield node.lineno, target


def layer_of(module: str, layers: Sequence[Set[str]], package: str) -> Tuple[int, str]:
    """``(layer index, unit)`` of a module of ``package``; unit is the subpackage or
    top-level module it belongs to. Raises KeyError for a module no layer lists."""
    rest = module[len(package) + 1 :] if module != package else ""
    unit = rest.split(".")[0]
    for i, units in enumerate(layers):
        if unit in units:
            return i, unit
    raise KeyError(unit)


#: symlinked folders inside the package: shipped in the wheel, outside every layer
#: (README, "Architecture"); the engine never imports them
LINKED = {"clients": "../clients", "triton/backend": "../../backend"}


def engine_files(package_root: Path) -> List[Path]:
    """The package's own ``.py`` files: the symlinked folders (:data:`LINKED`) left out."""
    out = []
    for folder, dirs, files in os.walk(package_root):  # followlinks=False
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        out += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(out)


def violations(
    package_root: Path, layers: Sequence[Set[str]] = LAYERS, forbidden: Sequence[str] = FORBIDDEN
) -> List[str]:
    """Every broken rule of the contract in the package at ``package_root``, as
    ``"file:line: what"`` (empty when the contract holds)."""
    package = package_root.name
    files = engine_files(package_root)
    names: Dict[Path, str] = {f: module_name(f, package_root) for f in files}
    known = set(names.values()) | {f"{package}._native"} | set(forbidden)
    out = []
    for f, name in names.items():
        where = f.relative_to(package_root.parent)
        try:
            mine, my_unit = layer_of(name, layers, package)
        except KeyError as e:
            out.append(f"{where}: {name} is in no layer ({e.args[0]!r}): add it to LAYERS")
            continue
        for line, target in imported_modules(f, name, known):
            bad = is_forbidden(target, forbidden)
            if bad:
                out.append(
                    f"{where}:{line}: {name} imports {target} (the engine never imports {bad})"
                )
                continue
            top = target.split(".")[0]
            if top != package:
                continue
            try:
                theirs, their_unit = layer_of(target, layers, package)
            except KeyError:
                out.append(f"{where}:{line}: {name} imports {target}, which is in no layer")
                continue
            if theirs > mine:
                out.append(
                    f"{where}:{line}: {name} (layer {my_unit!r}) imports {target} "
                    f"of the outer layer {their_unit!r}"
                )
            elif theirs == mine and their_unit != my_unit:
                out.append(
                    f"{where}:{line}: {name} imports {target}: {my_unit!r} and "
                    f"{their_unit!r} share a layer and are independent"
                )
    return out


def test_the_engine_keeps_its_import_contract():
    assert violations(ROOT / ENGINE) == []


def test_the_package_links_exactly_the_clients_and_the_backends():
    links = {
        str(p.relative_to(ROOT / ENGINE)): os.readlink(p)
        for p in (ROOT / ENGINE).rglob("*")
        if p.is_symlink()
    }
    assert links == LINKED


def test_the_wheel_ships_exactly_its_packages_and_none_imports_the_examples():
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert tuple(meta["tool"]["scikit-build"]["wheel"]["packages"]) == WHEEL_PACKAGES
    bad = []
    for package in WHEEL_PACKAGES:
        # os.walk follows the linked folders here: they ship in the wheel too
        for folder, _dirs, files in os.walk(ROOT / package, followlinks=True):
            for path in (Path(folder) / f for f in files if f.endswith(".py")):
                name = module_name(path, ROOT / package)
                for line, target in imported_modules(path, name, set()):
                    if target == "examples" or target.startswith("examples."):
                        bad.append(f"{path.relative_to(ROOT)}:{line}: imports {target}")
    assert bad == []


def test_every_layer_names_an_existing_package_or_module():
    present = {
        p.stem if p.suffix == ".py" else p.name
        for p in (ROOT / ENGINE).iterdir()
        if p.suffix == ".py" or p.is_dir()
    }
    present |= {"", "_native"}  # the package's __init__; the C++ module built by CMake
    listed = set().union(*LAYERS)
    assert listed <= present | {"__init__"}, listed - present


# -- the checker itself, on a throw-away package ---------------------------------------


def _package(tmp_path: Path, files: Dict[str, str]) -> Path:
    root = tmp_path / ENGINE
    for rel, text in {
        "__init__.py": "",
        "errors.py": "",
        "config/__init__.py": "",
        "config/ps_json.py": "from triton_rec.errors import x\n",
        "storage/__init__.py": "",
        "updates/__init__.py": "",
        "dense/__init__.py": "",
        "serving/__init__.py": "from triton_rec.storage import table\n",
        "storage/table.py": "from . import errors_alias\n",
        **files,
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_checker_accepts_a_package_that_keeps_the_contract(tmp_path):
    assert violations(_package(tmp_path, {})) == []


@pytest.mark.parametrize(
    "rel, text, expected",
    [
        ("storage/node_store.py", "from ps_loader import node_store\n", "never imports ps_loader"),
        ("storage/x.py", "def f():\n    import benchmarks.cache_sim\n", "never imports benchmarks"),
        ("config/x.py", "import tests.fake_pb_utils\n", "never imports tests"),
        (
            "serving/x.py",
            "from triton_rec.clients.hps_client import main\n",
            "never imports triton_rec.clients",
        ),
        ("serving/y.py", "from triton_rec import clients\n", "never imports triton_rec.clients"),
        (
            "serving/z.py",
            "from ..clients import hps_requests\n",
            "never imports triton_rec.clients",
        ),
        (
            "config/model_files.py",
            "from triton_rec.storage.table import T\n",
            "outer layer 'storage'",
        ),
        ("storage/y.py", "from triton_rec.serving import session\n", "outer layer 'serving'"),
        ("storage/z.py", "from ..serving import session\n", "outer layer 'serving'"),
        ("errors.py", "from triton_rec import serving\n", "outer layer 'serving'"),
        ("dense/x.py", "from triton_rec.updates import consumer\n", "independent"),
        ("newpkg/x.py", "", "in no layer"),
    ],
)
def test_the_checker_reports_a_forbidden_import(tmp_path, rel, text, expected):
    found = violations(_package(tmp_path, {rel: text}))
    assert len(found) == 1 and expected in found[0], found


def test_the_served_engine_imports_no_optional_store_client_it_does_not_use():
    # What the native backend hosts (inprocess and every backend's model.py) imports
    # redis-py (12 MB of a server's memory) and rocksdict (6 MB) only when a model's
    # tiers open them, not for every model.
    code = (
        "import importlib.util, sys\n"
        "import triton_rec.triton.inprocess as ip\n"
        "sys.modules['triton_python_backend_utils'] = ip\n"
        "for kind in ('hps', 'hugectr', 'dense'):\n"
        "    path = f'backend/{kind}/model.py'\n"
        "    spec = importlib.util.spec_from_file_location('m_' + kind, path)\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(sorted({n.split('.')[0] for n in sys.modules}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    loaded = set(json.loads(out.replace("'", '"')))
    assert "triton_rec" in loaded and "numpy" in loaded
    assert not loaded & {"redis", "rocksdict", "confluent_kafka", "onnxruntime"}, loaded
