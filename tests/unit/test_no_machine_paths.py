"""Nothing the repository tracks names an absolute path of a machine it was made on: a home
or root directory, or the development machines' checkout (under ``/work``). Benchmark output
copied in from a node is committed with those paths made relative (``.``, ``~``, ``OUT``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MACHINE_PATH = re.compile(rb"(?<![\w.~])/(?:work|root|home/[\w.-]+)/")


def test_no_tracked_file_names_a_machine_path():
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    found = []
    for name in filter(None, files):
        path = ROOT / name.decode()
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_bytes().splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{name.decode()}:{n}: {line[:120]!r}")
    assert not found, "\n".join(found[:20])


def test_the_pattern_finds_what_it_is_for():
    slash = b"/"  # (the examples are built: this file names no such path itself)
    for bad in (
        slash + b"work/main/x.py",
        b"p = '" + slash + b"root/.cache'",
        b" " + slash + b"home/al/r",
    ):
        assert MACHINE_PATH.search(bad), bad
    for fine in (b"~/.cache/triton-rec", b"./benchmarks/x", b"/dev/shm/trec", b"docs/work/x"):
        assert not MACHINE_PATH.search(fine), fine
