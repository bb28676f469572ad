"""Modules of one concern: no Python module of the engine, the loader or the backends over
:data:`PY_LIMIT` lines, no C++ file of src/ over :data:`CPP_LIMIT` (issue 36, item 4).

A file that grows past its limit is split along its concerns behind its import path (the
old module re-exports what moved, as triton_rec/dense/hugectr_network.py does for
triton_rec/dense/hugectr/). One that cannot be split yet is listed in :data:`EXCEPTIONS`
with the reason; an exception whose file is back under the limit (or gone) fails too, so
the list cannot outlive its reasons.

Plain stdlib: counts lines as ``wc -l`` does; symlinked folders (triton_rec/clients,
triton_rec/triton/backend) are counted where they live, once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]

PY_LIMIT = 700
CPP_LIMIT = 800
#: the folders whose Python modules are held to PY_LIMIT
PY_FOLDERS = ("triton_rec", "ps_loader", "backend")
#: the folder whose C++ files are held to CPP_LIMIT, and what counts as C++
CPP_FOLDER = "src"
CPP_SUFFIXES = (".cpp", ".cc", ".hpp", ".h", ".cu", ".cuh")
#: files allowed over their limit: path relative to the repository -> why (none today)
EXCEPTIONS: Dict[str, str] = {}


def files(root: Path, folders: Sequence[str], suffixes: Sequence[str]) -> Iterator[Path]:
    """The files under ``root/<folder>`` ending in one of ``suffixes``, symlinked folders
    left out (what they link to is counted where it lives)."""
    for folder in folders:
        for parent, dirs, names in os.walk(root / folder):  # followlinks=False
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(parent, d))]
            for name in names:
                path = Path(parent) / name
                if name.endswith(tuple(suffixes)) and not path.is_symlink():
                    yield path


def line_count(path: Path) -> int:
    """Lines of a file as ``wc -l`` counts them (newline characters)."""
    return path.read_bytes().count(b"\n")


def oversized(root: Path = ROOT) -> List[Tuple[str, int, int]]:
    """``(path, lines, limit)`` of every file over its limit, largest first."""
    found = [(p, PY_LIMIT) for p in files(root, PY_FOLDERS, (".py",))]
    found += [(p, CPP_LIMIT) for p in files(root, (CPP_FOLDER,), CPP_SUFFIXES)]
    out = []
    for path, limit in found:
        n = line_count(path)
        if n > limit:
            out.append((str(path.relative_to(root)), n, limit))
    return sorted(out, key=lambda t: -t[1])


def violations(root: Path = ROOT, exceptions: Dict[str, str] = EXCEPTIONS) -> List[str]:
    """What breaks the rule: a file over its limit that no exception names, and an
    exception whose file is no longer over its limit."""
    over = oversized(root)
    out = [
        f"{path}: {n} lines, over the limit of {limit}: split it along its concerns "
        "(re-exporting what moves), or list it in EXCEPTIONS with the reason"
        for path, n, limit in over
        if path not in exceptions
    ]
    still = {path for path, _, _ in over}
    out += [
        f"{path}: listed in EXCEPTIONS ({why}) but no longer over its limit: remove it"
        for path, why in exceptions.items()
        if path not in still
    ]
    return out


def test_no_module_is_over_its_limit():
    assert violations() == []


def test_every_exception_gives_its_reason():
    assert all(why.strip() for why in EXCEPTIONS.values())


# -- the checker itself, on a throw-away tree ------------------------------------------


def _tree(tmp_path: Path, sizes: Dict[str, int]) -> Path:
    for rel, lines in sizes.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n" * lines)
    return tmp_path


def test_the_checker_accepts_files_at_their_limit(tmp_path):
    root = _tree(
        tmp_path,
        {"triton_rec/a.py": PY_LIMIT, "backend/hps/model.py": 10, "src/native/x.hpp": CPP_LIMIT},
    )
    assert violations(root, {}) == []


def test_the_checker_reports_a_file_one_line_over(tmp_path):
    root = _tree(
        tmp_path,
        {
            "ps_loader/big.py": PY_LIMIT + 1,
            "src/triton_backend/trec/big.cpp": CPP_LIMIT + 1,
            "src/native/fine.cpp": PY_LIMIT + 1,  # C++ has the larger limit
            "tests/unit/test_huge.py": 5000,  # tests are not held to it
        },
    )
    found = violations(root, {})
    assert len(found) == 2, found
    assert found[0].startswith("src/triton_backend/trec/big.cpp: 801 lines")
    assert found[1].startswith("ps_loader/big.py: 701 lines")


def test_the_checker_counts_a_linked_folder_once(tmp_path):
    root = _tree(tmp_path, {"backend/dense/model.py": PY_LIMIT + 1})
    (root / "triton_rec").mkdir()
    (root / "triton_rec" / "backend").symlink_to("../backend")
    assert len(violations(root, {})) == 1


def test_the_checker_holds_exceptions_to_their_reason(tmp_path):
    root = _tree(tmp_path, {"triton_rec/big.py": PY_LIMIT + 1, "triton_rec/small.py": 1})
    assert violations(root, {"triton_rec/big.py": "one generated table"}) == []
    stale = violations(root, {"triton_rec/big.py": "x", "triton_rec/small.py": "was big"})
    assert len(stale) == 1 and "no longer over its limit" in stale[0]
