"""Quantize trained tables into fp16 or int8 (``ps-loader quantize``), with their error.

Reads HugeCTR sparse directories or ``.npz`` tables (one given path, or every table of a
ps.json), encodes them with :class:`triton_rec.precision.RowCodec` (the one definition
of each precision, the same code the server runs when it converts a table itself) and
writes encoded ``.npz`` tables (:mod:`triton_rec.formats.npz_table`), which the node
store takes as they are. Reports per table the bytes per row before and after and the
error of every value against the source: max abs and RMS.

Optionally writes a copy of the ps.json whose ``sparse_files`` name the written tables
and whose ``embedding_precision`` names their precision, ready to serve.

A source already in the requested precision (an encoded ``.npz``) is copied row for row,
not requantized (its error against itself is 0), as the node store takes it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from triton_rec.formats.tables import is_npz, read_table_rows, write_table_rows
from triton_rec.precision import RowCodec, transcode

# values per chunk when encoding and measuring the error (bounds the float64 temporaries)
_CHUNK_VALUES = 1 << 22


@dataclass
class QuantizedTable:
    """One table written by :func:`quantize_table`.

    Attributes:
        label: ``model.table`` or the source's name.
        source, path: the table read and the ``.npz`` written.
        rows, dim: table shape; precision: what ``path`` holds.
        bytes_before, bytes_after: bytes per row of the source and of the written rows.
        max_abs, rms: the error of every value (decoded written row - source value).
        copied: the source already held ``precision``: its rows were written as they are.
    """

    label: str
    source: str
    path: str
    precision: str
    rows: int
    dim: int
    bytes_before: int
    bytes_after: int
    max_abs: float
    rms: float
    copied: bool = False

    @property
    def table_bytes_before(self) -> int:
        """Bytes of all the source's rows."""
        return self.rows * self.bytes_before

    @property
    def table_bytes_after(self) -> int:
        """Bytes of all the written rows."""
        return self.rows * self.bytes_after

    def as_dict(self) -> dict:
        """The fields and the table totals (the JSON report's object)."""
        d = asdict(self)
        d["table_bytes_before"] = self.table_bytes_before
        d["table_bytes_after"] = self.table_bytes_after
        return d


def quantize_rows(rows: np.ndarray, src: RowCodec, codec: RowCodec):
    """``rows`` of ``src`` encoded in ``codec``, in chunks (:func:`~triton_rec.precision
    .transcode`). Returns ``(rows, max_abs, rms)``: the error of the decoded encoded
    values against the source's values, as :meth:`RowCodec.roundtrip_error` defines it
    (in float64), measured chunk by chunk on the rows encoded once: the maxima combine by
    max, the RMS from the summed squares over all ``n * dim`` values."""
    worst, squares = 0.0, 0.0

    def measure(a: int, b: int, vectors: np.ndarray, encoded: np.ndarray) -> None:
        nonlocal worst, squares
        d = codec.decode(encoded).astype(np.float64) - vectors
        if d.size:
            worst = max(worst, float(np.abs(d).max()))
            squares += float(np.einsum("ij,ij->", d, d))

    out = transcode(rows, src, codec, _CHUNK_VALUES, measure)
    n = int(rows.shape[0])
    rms = math.sqrt(squares / (n * codec.dim)) if n else 0.0
    return out, worst, rms


def quantize_table(
    source: str, vec_size: int, precision: str, path: str, label: Optional[str] = None
) -> QuantizedTable:
    """Encode the table at ``source`` into ``precision`` and write it to ``path`` (.npz).

    A source already holding ``precision`` is written row for row (``copied``, error 0).
    Raises :class:`triton_rec.errors.ModelFileError` for an unreadable source."""
    keys, rows, src = read_table_rows(source, vec_size)
    codec = RowCodec(precision, vec_size)
    copied = src == codec
    if copied:  # requantizing decoded int8 values need not give the same bytes back
        out, worst, rms = rows, 0.0, 0.0
    else:
        out, worst, rms = quantize_rows(rows, src, codec)
    write_table_rows(path, keys, out, codec)
    return QuantizedTable(
        label or os.path.basename(os.path.normpath(source)),
        source,
        path,
        precision,
        int(keys.shape[0]),
        vec_size,
        src.row_bytes,
        codec.row_bytes,
        worst,
        rms,
        copied,
    )


def output_name(label: str, precision: str) -> str:
    """File name of a quantized table: ``<label>.<precision>.npz`` (a source's ``.npz``
    suffix dropped, path separators replaced)."""
    base = label[: -len(".npz")] if is_npz(label) else label
    return f"{base.replace(os.sep, '_')}.{precision}.npz"


def rewrite_ps_json(
    ps_path: str, written: Dict[str, Sequence[QuantizedTable]], out_path: str
) -> None:
    """A copy of ``ps_path`` in which each model of ``written`` (model -> its tables in
    ps.json order) names the written tables (paths relative to ``out_path``'s
    directory) and their ``embedding_precision``."""
    with open(ps_path, encoding="utf-8") as f:
        doc = json.load(f)
    base = os.path.dirname(os.path.abspath(out_path))
    for entry in doc.get("models", []):
        tables = written.get(entry.get("model"))
        if not tables:
            continue
        entry["sparse_files"] = [os.path.relpath(os.path.abspath(t.path), base) for t in tables]
        entry["embedding_precision"] = [t.precision for t in tables]
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def describe(t: QuantizedTable) -> str:
    """One line of the command's report."""
    how = " (already in this precision: copied)" if t.copied else ""
    return (
        f"{t.label}: {t.rows} rows x {t.dim}, {t.bytes_before} -> {t.bytes_after} B/row "
        f"({t.bytes_after / t.bytes_before:.3f}x; table {t.table_bytes_before:,} -> "
        f"{t.table_bytes_after:,} B), max abs error {t.max_abs:.3g}, "
        f"RMS {t.rms:.3g} -> {t.path}{how}"
    )


def as_json(tables: List[QuantizedTable]) -> str:
    """The report as a JSON list (one object per table)."""
    return json.dumps([t.as_dict() for t in tables], indent=1)
