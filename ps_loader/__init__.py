"""ps_loader: readers, validators and writers for trained embedding-table files.

Formats:

- HugeCTR sparse model directory (``<prefix><i>_sparse_<iter>.model/``) holding
  ``key`` (int64, little-endian, no header) and ``emb_vector`` (float32 rows);
  see :mod:`ps_loader.hugectr_sparse`.
- numpy ``.npz`` with arrays ``keys`` (int64, [N]) and ``vectors`` (float32, [N, D]);
  see :mod:`ps_loader.npz_table`.

:func:`ps_loader.tables.read_table` picks the reader from the path. Every reader
validates sizes and raises :class:`triton_rec.errors.ModelFileError` naming the file.
"""

from ps_loader.tables import read_table, write_table  # noqa: F401
