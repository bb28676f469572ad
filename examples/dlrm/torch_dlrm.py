"""A small DLRM in PyTorch with HugeCTR's inference semantics, and its exporters.

Used by ``model_repository/dlrm/train.py`` (train on generated clicks, export) and by
tests that compare what the exported files compute with what PyTorch computes.
Importing this module imports torch; nothing else in ``ps_loader`` needs it.

The network is exactly what HugeCTR's layers compute (``hugectr-layers.md``):

- per table, a ``DistributedSlotSparseEmbeddingHash``: per slot, the sum of the slot's
  vectors, divided by the key count when the combiner is ``mean`` and the count > 1;
  an empty slot gives zeros; a key missing from the table counts as a vector filled with
  the table's default value. Output ``[B, slot_num, vec]``.
- bottom MLP: ``InnerProduct`` + ``ReLU`` pairs on the dense features, the last one of
  width ``vec``;
- ``Concat`` of the tables' outputs along axis 1 (when there are several tables);
- ``Interaction``: ``Z = [mlp; emb_0 .. emb_{S-1}]`` (n = S + 1 rows), output = ``mlp``,
  then ``<Z_i, Z_j>`` for i = 1..n-1, j = 0..i-1 ((1,0), (2,0), (2,1), (3,0), ...), then one
  padding element equal to 0: width ``vec + n(n-1)/2 + 1``;
- top MLP: ``InnerProduct`` + ``ReLU`` pairs, then ``InnerProduct`` to 1;
- ``BinaryCrossEntropyLoss`` in training, a sigmoid at inference.

Files written by :func:`export` into a model version directory (``<name>`` = ``dlrm``):

- ``<name><i>_sparse_0.model/``: table i as a HugeCTR sparse directory (keys = the
  categorical ids of the data, in row order);
- ``<name>_dense_0.model`` + ``<name>.json``: HugeCTR dense file (float32 parameters in
  the network JSON's layer order, InnerProduct W as ``[in, out]`` row-major then b) and
  network JSON;
- ``<name>_dense.onnx``: the dense part (inputs ``dense`` ``[B, dense_dim]`` and
  ``emb_<t>`` ``[B, slot_num_t, vec]``, combined per slot; output ``prob`` ``[B, 1]``);
- ``<name>_torch.pt``: the state dict (plain tensors; ``torch.load(weights_only=True)``);
- ``<name>_meta.json``: hyper-parameters (rebuild with :func:`build_model`) and metrics;
- ``<name>_ps_entry.json``: the model's ``models[]`` entry for ps.json.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from triton_rec.formats.hugectr_sparse import write_sparse_dir

META_FORMAT = "triton-rec-dlrm/1"
COMBINERS = ("sum", "mean")


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class TableSpec:
    """One embedding table.

    Args:
        name: table name (letters, digits, ``_``; a state-dict key component).
        rows: number of keys.
        slot_num: slots per sample.
        max_keys_per_slot: keys per slot are drawn from 1..this (1 = one-hot).
        combiner: ``sum`` or ``mean``.
        vec_size: floats per vector.
    """

    name: str
    rows: int
    slot_num: int
    max_keys_per_slot: int = 1
    combiner: str = "sum"
    vec_size: int = 16

    def __post_init__(self):
        if self.combiner not in COMBINERS:
            raise ValueError(f"table {self.name}: combiner must be one of {COMBINERS}")
        if min(self.rows, self.slot_num, self.max_keys_per_slot, self.vec_size) < 1:
            raise ValueError(f"table {self.name}: sizes must be >= 1: {self}")
        if self.rows < self.slot_num:
            raise ValueError(f"table {self.name}: needs at least one row per slot")

    @property
    def max_feature_num_per_sample(self) -> int:
        """Most keys one sample holds in this table (HugeCTR's ``max_feature_num``)."""
        return self.slot_num * self.max_keys_per_slot


@dataclass(frozen=True)
class DLRMConfig:
    """Hyper-parameters of the network.

    Args:
        dense_dim: dense features per sample.
        tables: the embedding tables (all of one ``vec_size``: Interaction needs it).
        bottom_mlp: widths of the bottom MLP; the last must equal ``vec_size``.
        top_mlp: widths of the top MLP's hidden layers (a final layer of width 1 follows).
    """

    dense_dim: int
    tables: Tuple[TableSpec, ...]
    bottom_mlp: Tuple[int, ...]
    top_mlp: Tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "tables", tuple(self.tables))
        object.__setattr__(self, "bottom_mlp", tuple(int(w) for w in self.bottom_mlp))
        object.__setattr__(self, "top_mlp", tuple(int(w) for w in self.top_mlp))
        if not self.tables:
            raise ValueError("at least one table is needed")
        vecs = {t.vec_size for t in self.tables}
        if len(vecs) != 1:
            raise ValueError(f"Interaction needs one vec_size for every table, got {sorted(vecs)}")
        if not self.bottom_mlp or self.bottom_mlp[-1] != self.vec_size:
            raise ValueError(
                f"the bottom MLP must end with width vec_size={self.vec_size}: {self.bottom_mlp}"
            )
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names: {names}")

    @property
    def vec_size(self) -> int:
        """Embedding vector size (the same for every table)."""
        return self.tables[0].vec_size

    @property
    def total_slots(self) -> int:
        """Slots of all tables together."""
        return sum(t.slot_num for t in self.tables)

    @property
    def interaction_dim(self) -> int:
        """Width of the interaction output: the bottom MLP's output and the pairwise dots."""
        n = self.total_slots + 1
        return self.vec_size + n * (n - 1) // 2 + 1

    def to_meta(self) -> Dict:
        """The hyper-parameters as a JSON-able dict (stored beside exported models)."""
        return {
            "dense_dim": self.dense_dim,
            "vec_size": self.vec_size,
            "tables": [asdict(t) for t in self.tables],
            "bottom_mlp": list(self.bottom_mlp),
            "top_mlp": list(self.top_mlp),
        }

    @classmethod
    def from_meta(cls, meta: Dict) -> DLRMConfig:
        """The inverse of :meth:`to_meta` (``vec_size`` per table defaults to the model's)."""
        tables = []
        for t in meta["tables"]:
            t = dict(t)
            t.setdefault("vec_size", meta.get("vec_size", 16))
            tables.append(TableSpec(**{k: t[k] for k in TableSpec.__dataclass_fields__ if k in t}))
        return cls(meta["dense_dim"], tuple(tables), meta["bottom_mlp"], meta["top_mlp"])


#: The model trained by ``model_repository/dlrm/train.py``: a one-hot table of 4 slots
#: (sum) and a multi-hot table of 2 slots with 1-3 keys each (mean).
DEFAULT_CONFIG = DLRMConfig(
    dense_dim=8,
    tables=(
        TableSpec("table0", rows=4000, slot_num=4, max_keys_per_slot=1, combiner="sum"),
        TableSpec("table1", rows=2000, slot_num=2, max_keys_per_slot=3, combiner="mean"),
    ),
    bottom_mlp=(32, 16),
    top_mlp=(64, 32),
)
#: Same layout, small enough to train in a unit test (about a second).
TINY_CONFIG = DLRMConfig(
    dense_dim=8,
    tables=(
        TableSpec("table0", rows=400, slot_num=4, max_keys_per_slot=1, combiner="sum"),
        TableSpec("table1", rows=200, slot_num=2, max_keys_per_slot=3, combiner="mean"),
    ),
    bottom_mlp=(16, 16),
    top_mlp=(32, 16),
)


@dataclass(frozen=True)
class TrainSettings:
    """Training run settings (defaults: the full run of ``train.py``)."""

    seed: int = 2026
    epochs: int = 2
    train_rows: int = 262144
    eval_rows: int = 16384
    batch_size: int = 512
    lr: float = 5e-3


TINY_SETTINGS = TrainSettings(epochs=3, train_rows=8192, eval_rows=4096, batch_size=128, lr=5e-3)


# --------------------------------------------------------------------------- layers


def interaction(
    mlp: torch.Tensor, emb: torch.Tensor, pair_index: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """HugeCTR ``Interaction``: ``[B, d]``, ``[B, S, d]`` -> ``[B, d + n(n-1)/2 + 1]``, n = S+1.

    ``pair_index`` (from :func:`pair_index_list`) may be passed to avoid rebuilding it.
    """
    n = emb.shape[1] + 1
    if pair_index is None:
        pair_index = torch.as_tensor(pair_index_list(n), dtype=torch.int64, device=mlp.device)
    z = torch.cat([mlp.unsqueeze(1), emb], dim=1)
    gram = torch.bmm(z, z.transpose(1, 2)).flatten(1)
    pairs = gram.index_select(1, pair_index)
    return torch.cat([mlp, pairs, torch.zeros_like(mlp[:, :1])], dim=1)


def pair_index_list(n: int) -> List[int]:
    """Flat ``i * n + j`` of HugeCTR's pair order: (1,0), (2,0), (2,1), (3,0), ..."""
    return [i * n + j for i in range(1, n) for j in range(i)]


class DenseArch(nn.Module):
    """The dense part: ``(dense [B, dense_dim], emb_0 [B, S_0, vec], ...) -> prob [B, 1]``.

    Args:
        config: the network's hyper-parameters.
    """

    def __init__(self, config: DLRMConfig):
        super().__init__()
        layers: List[nn.Module] = []
        width = config.dense_dim
        for w in config.bottom_mlp:
            layers += [nn.Linear(width, w), nn.ReLU()]
            width = w
        self.bottom = nn.Sequential(*layers)
        layers = []
        width = config.interaction_dim
        for w in config.top_mlp:
            layers += [nn.Linear(width, w), nn.ReLU()]
            width = w
        layers.append(nn.Linear(width, 1))
        self.top = nn.Sequential(*layers)
        n = config.total_slots + 1
        self.register_buffer(
            "pair_index", torch.tensor(pair_index_list(n), dtype=torch.int64), persistent=False
        )

    def logits(self, dense: torch.Tensor, *embs: torch.Tensor) -> torch.Tensor:
        """``[B, 1]`` logits from dense features and pooled embeddings (``[B, slots, D]``)."""
        emb = embs[0] if len(embs) == 1 else torch.cat(embs, dim=1)
        return self.top(interaction(self.bottom(dense), emb, self.pair_index))

    def forward(self, dense: torch.Tensor, *embs: torch.Tensor) -> torch.Tensor:
        """Click probabilities ``[B, 1]``: the sigmoid of :meth:`logits`."""
        return torch.sigmoid(self.logits(dense, *embs))


class _Keys(nn.Module):
    """Holds one int64 buffer per table: the key of every row (saved in the state dict)."""

    def __init__(self, tables: Sequence[TableSpec]):
        super().__init__()
        for t in tables:
            self.register_buffer(t.name, torch.arange(t.rows, dtype=torch.int64))


class DLRM(nn.Module):
    """Embedding tables (keys and vectors) + :class:`DenseArch`.

    State dict: ``embedding_bags.<table>.weight`` ``[rows, vec]``, ``sparse_keys.<table>``
    (int64 key of each row), ``dense_arch.bottom.<i>.weight/bias``, ``dense_arch.top...``.

    Args:
        config: the network's hyper-parameters.
    """

    def __init__(self, config: DLRMConfig):
        super().__init__()
        self.config = config
        self.embedding_bags = nn.ModuleDict(
            {
                t.name: nn.EmbeddingBag(t.rows, t.vec_size, mode="sum", include_last_offset=True)
                for t in config.tables
            }
        )
        for bag in self.embedding_bags.values():
            nn.init.normal_(bag.weight, std=0.05)
        self.sparse_keys = _Keys(config.tables)
        self.dense_arch = DenseArch(config)
        self.meta: Dict = {}

    # -- keys
    def table_keys(self, t: int) -> np.ndarray:
        """The int64 key of each row of table ``t``."""
        return getattr(self.sparse_keys, self.config.tables[t].name).cpu().numpy()

    def set_table_keys(self, t: int, keys: np.ndarray) -> None:
        """Set the keys of table ``t``'s rows (``rows`` unique int64 keys)."""
        keys = np.asarray(keys, dtype=np.int64)
        spec = self.config.tables[t]
        if keys.shape != (spec.rows,) or np.unique(keys).shape[0] != spec.rows:
            raise ValueError(f"table {spec.name}: need {spec.rows} unique keys, got {keys.shape}")
        getattr(self.sparse_keys, spec.name).copy_(torch.from_numpy(keys))

    def rows_of(self, t: int, keys: np.ndarray) -> np.ndarray:
        """Row of each key of table ``t`` (int64), -1 for keys not in the table."""
        table = self.table_keys(t)
        order = np.argsort(table, kind="stable")
        sorted_keys = table[order]
        keys = np.asarray(keys, dtype=np.int64)
        pos = np.searchsorted(sorted_keys, keys).clip(0, max(len(table) - 1, 0))
        found = sorted_keys[pos] == keys if len(table) else np.zeros(keys.shape, bool)
        return np.where(found, order[pos], -1).astype(np.int64)

    # -- embeddings
    def pooled(
        self, t: int, rows: torch.Tensor, offsets: torch.Tensor, default: float = 0.0
    ) -> torch.Tensor:
        """Combined vectors ``[B, slot_num, vec]`` of table ``t``.

        Args:
            rows: int64 row of every key (-1: key not in the table -> ``default`` vector).
            offsets: int64 CSR row pointers, ``B * slot_num + 1`` values from 0.
        """
        spec = self.config.tables[t]
        bag = self.embedding_bags[spec.name]
        counts = offsets[1:] - offsets[:-1]
        unknown = rows < 0
        if bool(unknown.any()):
            weights = (~unknown).to(bag.weight.dtype)
            out = bag(rows.clamp(min=0), offsets, per_sample_weights=weights)
            slot_of_key = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
            n_unknown = torch.zeros(counts.shape[0], dtype=out.dtype).index_add_(
                0, slot_of_key, unknown.to(out.dtype)
            )
            out = out + n_unknown.unsqueeze(1) * default
        else:
            out = bag(rows, offsets)
        if spec.combiner == "mean":
            out = out / counts.clamp(min=1).unsqueeze(1).to(out.dtype)
        return out.reshape(-1, spec.slot_num, spec.vec_size)

    def logits(
        self,
        dense: torch.Tensor,
        sparse: Sequence[Tuple[torch.Tensor, torch.Tensor]],
        defaults: Optional[Sequence[float]] = None,
    ) -> torch.Tensor:
        """``[B, 1]`` logits from dense features and per-table ``(rows, offsets)``."""
        defaults = defaults or [0.0] * len(sparse)
        embs = [self.pooled(t, r, o, defaults[t]) for t, (r, o) in enumerate(sparse)]
        return self.dense_arch.logits(dense, *embs)

    def forward(self, dense, sparse, defaults=None) -> torch.Tensor:
        """Click probabilities ``[B, 1]``: the sigmoid of :meth:`logits`."""
        return torch.sigmoid(self.logits(dense, sparse, defaults))

    @torch.no_grad()
    def predict(
        self,
        dense: np.ndarray,
        sparse: Sequence[Tuple[np.ndarray, np.ndarray]],
        defaults: Optional[Sequence[float]] = None,
        batch_size: int = 8192,
    ) -> np.ndarray:
        """Click probabilities ``[B]`` (float32) for keys (not rows): ``sparse[t] =
        (keys int64, offsets)`` with ``B * slot_num_t + 1`` CSR offsets, as in HugeCTR's
        ``CATCOLUMN``/``ROWINDEX`` regrouped by table. Unknown keys get ``defaults[t]``."""
        dense = np.asarray(dense, np.float32)
        rows = [(self.rows_of(t, k), np.asarray(o, np.int64)) for t, (k, o) in enumerate(sparse)]
        out = []
        for a in range(0, dense.shape[0], batch_size):
            b = min(a + batch_size, dense.shape[0])
            batch = [
                _csr_slice(r, o, a * s, b * s)
                for (r, o), s in zip(rows, (t.slot_num for t in self.config.tables))
            ]
            out.append(self.forward(torch.from_numpy(dense[a:b]), batch, defaults)[:, 0].numpy())
        return np.concatenate(out) if out else np.empty(0, np.float32)


def _csr_slice(rows: np.ndarray, offsets: np.ndarray, a: int, b: int):
    """Bags ``a..b`` of a CSR layout as torch tensors (offsets rebased to 0)."""
    o = offsets[a : b + 1]
    return torch.from_numpy(rows[o[0] : o[-1]]), torch.from_numpy(o - o[0])


def build_model(meta: Union[Dict, DLRMConfig]) -> DLRM:
    """An untrained :class:`DLRM` from a config or a ``dlrm_meta.json`` dict."""
    config = meta if isinstance(meta, DLRMConfig) else DLRMConfig.from_meta(meta)
    model = DLRM(config)
    if isinstance(meta, dict):
        model.meta = meta
    return model


def load_trained(model_dir: str, name: str = "dlrm") -> DLRM:
    """The trained model exported by :func:`export` (eval mode, ``.meta`` = the meta JSON)."""
    with open(os.path.join(model_dir, f"{name}_meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    model = build_model(meta)
    state = torch.load(
        os.path.join(model_dir, f"{name}_torch.pt"), map_location="cpu", weights_only=True
    )
    model.load_state_dict(state)
    return model.eval()


# --------------------------------------------------------------------------- data


@dataclass
class ClickData:
    """Generated samples.

    Args:
        dense: float32 ``[n, dense_dim]``.
        sparse: per table ``(keys int64, offsets int64 [n * slot_num + 1])`` (CSR per slot).
        labels: float32 ``[n]`` (0/1).
        true_logits: float32 ``[n]``: the hidden model's logits (for the oracle AUC).
    """

    dense: np.ndarray
    sparse: List[Tuple[np.ndarray, np.ndarray]]
    labels: np.ndarray
    true_logits: np.ndarray

    def __len__(self) -> int:
        return self.dense.shape[0]

    def hugectr_request(self, a: int = 0, b: Optional[int] = None) -> Dict[str, np.ndarray]:
        """Samples ``a..b`` as HugeCTR backend inputs: ``DES`` float32 (flat, sample-major),
        ``CATCOLUMN`` int64 (sample-major: each sample's table 0 keys, table 1 keys, ...),
        ``ROWINDEX`` int32 (per-table CSR offsets, concatenated)."""
        b = len(self) if b is None else b
        n = b - a
        cat, rowindex = [], []
        per_sample = []
        for keys, offsets in self.sparse:
            s = (len(offsets) - 1) // len(self)
            o = offsets[a * s : b * s + 1]
            rowindex.append((o - o[0]).astype(np.int32))
            sample_ptr = o[::s]  # n + 1 pointers of whole samples
            per_sample.append([keys[sample_ptr[i] : sample_ptr[i + 1]] for i in range(n)])
        for i in range(n):
            for table in per_sample:
                cat.append(table[i])
        catcolumn = np.concatenate(cat).astype(np.int64) if cat else np.empty(0, np.int64)
        return {
            "DES": np.ascontiguousarray(self.dense[a:b]).reshape(-1),
            "CATCOLUMN": catcolumn,
            "ROWINDEX": np.concatenate(rowindex),
        }

    def ensemble_request(self, a: int = 0, b: Optional[int] = None) -> Dict[str, np.ndarray]:
        """The same samples as :meth:`hugectr_request` in the ensemble's layout: ``DES``,
        ``KEYS`` (table-major), ``NUMKEYS`` (keys per table) and ``ROWINDEX``."""
        b = len(self) if b is None else b
        req = self.hugectr_request(a, b)
        keys, counts = [], []
        for k, offsets in self.sparse:
            s = (len(offsets) - 1) // len(self)
            part = k[offsets[a * s] : offsets[b * s]]
            keys.append(part)
            counts.append(len(part))
        return {
            "DES": req["DES"],
            "KEYS": np.concatenate(keys).astype(np.int64),
            "NUMKEYS": np.array(counts, np.int32),
            "ROWINDEX": req["ROWINDEX"],
        }


def make_table_keys(seed: int, t: int, rows: int) -> np.ndarray:
    """Unique, non-contiguous, non-negative int64 ids (hash-like) for table ``t``'s rows."""
    rng = np.random.default_rng([seed, t, 7])
    keys = np.unique(rng.integers(1, 2**62, size=rows + rows // 4 + 16, dtype=np.int64))
    if keys.shape[0] < rows:  # practically unreachable
        raise RuntimeError("could not draw enough unique keys")
    rng.shuffle(keys)
    return keys[:rows]


class HiddenModel:
    """The ground truth that generates clicks (a logistic model with per-key effects).

    ``logit = x @ a + 0.5 * x_0 * x_1 + sum_slots pooled(bias) +
    sum_pairs <pooled(z) of slot p, pooled(z) of slot q> + c``, pooled with each table's
    combiner; keys within a slot follow a Zipf-like popularity.

    Args:
        config: the network layout (tables, slots, combiners).
        seed: everything (keys, effects) is a function of it.
    """

    LATENT = 4

    def __init__(self, config: DLRMConfig, seed: int):
        self.config = config
        rng = np.random.default_rng([seed, 1])
        self.keys = [make_table_keys(seed, t, spec.rows) for t, spec in enumerate(config.tables)]
        self.dense_w = rng.normal(0.0, 0.6, config.dense_dim)
        self.bias = [rng.normal(0.0, 0.6, spec.rows) for spec in config.tables]
        self.latent = [rng.normal(0.0, 0.6, (spec.rows, self.LATENT)) for spec in config.tables]
        self.intercept = -0.3
        # Slot ranges and popularity: slot s of table t uses its own block of rows.
        self.slot_rows = []
        for spec in config.tables:
            bounds = np.linspace(0, spec.rows, spec.slot_num + 1).astype(np.int64)
            slots = []
            for s in range(spec.slot_num):
                m = int(bounds[s + 1] - bounds[s])
                p = 1.0 / (np.arange(m) + 5.0) ** 1.05
                slots.append((int(bounds[s]), rng.permutation(m), p / p.sum()))
            self.slot_rows.append(slots)
        # Interacting slot pairs (global slot numbers): consecutive slots, and first with last.
        total = config.total_slots
        self.pairs = [(g, g + 1) for g in range(0, total - 1, 2)]
        if total > 2:
            self.pairs.append((0, total - 1))

    def sample(self, n: int, rng: np.random.Generator) -> ClickData:
        """``n`` samples drawn from the hidden model: dense features, keys per table and clicks."""
        cfg = self.config
        dense = rng.standard_normal((n, cfg.dense_dim)).astype(np.float32)
        logit = dense @ self.dense_w + 0.5 * dense[:, 0] * dense[:, 1] + self.intercept
        pooled_z = []
        sparse = []
        for t, spec in enumerate(cfg.tables):
            counts = rng.integers(1, spec.max_keys_per_slot + 1, size=(n, spec.slot_num))
            offsets = np.zeros(n * spec.slot_num + 1, np.int64)
            np.cumsum(counts.reshape(-1), out=offsets[1:])
            rows = np.empty(offsets[-1], np.int64)
            flat_counts = counts.reshape(-1)
            slot_of_bag = np.tile(np.arange(spec.slot_num), n)
            for s, (start, perm, p) in enumerate(self.slot_rows[t]):
                bag_mask = slot_of_bag == s
                key_mask = np.repeat(bag_mask, flat_counts)
                rows[key_mask] = start + perm[rng.choice(len(p), size=int(key_mask.sum()), p=p)]
            bag_of_key = np.repeat(np.arange(n * spec.slot_num), flat_counts)
            div = flat_counts if spec.combiner == "mean" else np.ones_like(flat_counts)
            bias = np.bincount(bag_of_key, self.bias[t][rows], minlength=n * spec.slot_num) / div
            logit += bias.reshape(n, spec.slot_num).sum(1)
            z = np.stack(
                [
                    np.bincount(bag_of_key, self.latent[t][rows, k], minlength=len(div)) / div
                    for k in range(self.LATENT)
                ],
                axis=1,
            )
            pooled_z.append(z.reshape(n, spec.slot_num, self.LATENT))
            sparse.append((self.keys[t][rows], offsets))
        z_all = np.concatenate(pooled_z, axis=1)
        for p, q in self.pairs:
            logit += np.einsum("bk,bk->b", z_all[:, p], z_all[:, q])
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return ClickData(dense, sparse, labels, logit.astype(np.float32))


# --------------------------------------------------------------------------- metrics


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC (rank-based, ties get their average rank); NaN without both classes."""
    labels = np.asarray(labels).astype(bool).reshape(-1)
    scores = np.asarray(scores, np.float64).reshape(-1)
    n_pos = int(labels.sum())
    n_neg = labels.shape[0] - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), np.float64)
    # average rank (1-based) of each group of equal scores
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


# --------------------------------------------------------------------------- training


@dataclass
class TrainResult:
    """What :func:`train` returns."""

    model: DLRM
    truth: HiddenModel
    eval_data: ClickData
    metrics: Dict[str, float] = field(default_factory=dict)


def train(
    config: DLRMConfig = DEFAULT_CONFIG, settings: TrainSettings = TrainSettings(), log=None
) -> TrainResult:
    """Generate clicks from a :class:`HiddenModel`, train a :class:`DLRM`, evaluate it.

    Deterministic for a given ``settings.seed``: torch runs single-threaded (the thread
    count is restored afterwards) and the global torch RNG is left untouched.
    """
    t0 = time.perf_counter()
    truth = HiddenModel(config, settings.seed)
    rng = np.random.default_rng([settings.seed, 2])
    train_data = truth.sample(settings.train_rows, rng)
    eval_data = truth.sample(settings.eval_rows, rng)
    t_data = time.perf_counter() - t0

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # enable_grad: independent of the caller's (or another module's) global grad mode
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.manual_seed(settings.seed)
            model = DLRM(config)
            for t, keys in enumerate(truth.keys):
                model.set_table_keys(t, keys)
            _fit(model, train_data, settings, rng, log)
        model.eval()
        t_train = time.perf_counter() - t0 - t_data
        prob = model.predict(eval_data.dense, eval_data.sparse)
    finally:
        torch.set_num_threads(threads)
    metrics = {
        "eval_rows": len(eval_data),
        "auc": auc(eval_data.labels, prob),
        "accuracy": float(((prob >= 0.5) == (eval_data.labels > 0.5)).mean()),
        "oracle_auc": auc(eval_data.labels, eval_data.true_logits),
        "click_rate": float(eval_data.labels.mean()),
        "data_seconds": round(t_data, 3),
        "train_seconds": round(t_train, 3),
    }
    return TrainResult(model, truth, eval_data, metrics)


def _fit(model: DLRM, data: ClickData, settings: TrainSettings, rng, log) -> None:
    slots = [t.slot_num for t in model.config.tables]
    rows = [(model.rows_of(t, k), o) for t, (k, o) in enumerate(data.sparse)]
    dense = torch.from_numpy(data.dense)
    labels = torch.from_numpy(data.labels).unsqueeze(1)
    opt = _Adam(list(model.parameters()), lr=settings.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    bs = settings.batch_size
    starts = np.arange(0, len(data), bs)
    model.train()
    for epoch in range(settings.epochs):
        total = 0.0
        for a in rng.permutation(starts):  # samples are i.i.d.: shuffle whole batches
            b = min(a + bs, len(data))
            sparse = [_csr_slice(r, o, a * s, b * s) for (r, o), s in zip(rows, slots)]
            loss = loss_fn(model.logits(dense[a:b], sparse), labels[a:b])
            model.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * (b - a)
        if log:
            log(f"epoch {epoch + 1}/{settings.epochs}: train loss {total / len(data):.4f}")


class _Adam:
    """Plain Adam (Kingma & Ba). ``torch.optim``'s first use imports ``torch._dynamo``
    (about 3 s), which is most of a small training run."""

    def __init__(self, params: List[torch.Tensor], lr: float, betas=(0.9, 0.999), eps=1e-8):
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1**self.t, 1 - b2**self.t
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            p.addcdiv_(m, (v / c2).sqrt_().add_(self.eps), value=-self.lr / c1)


# --------------------------------------------------------------------------- export


def hugectr_layers(model: DLRM) -> List[Tuple[Dict, List[np.ndarray]]]:
    """The network JSON layers with each layer's parameters (dense-file order)."""
    cfg = model.config
    data = {
        "name": "data",
        "type": "Data",
        "label": {"top": "label", "label_dim": 1},
        "dense": {"top": "dense", "dense_dim": cfg.dense_dim},
        "sparse": [
            {
                "top": f"data{t}",
                "type": "DistributedSlot",
                "max_feature_num_per_sample": spec.max_feature_num_per_sample,
                "slot_num": spec.slot_num,
            }
            for t, spec in enumerate(cfg.tables)
        ],
    }
    out: List[Tuple[Dict, List[np.ndarray]]] = [(data, [])]
    for t, spec in enumerate(cfg.tables):
        out.append(
            (
                {
                    "name": f"sparse_embedding{t}",
                    "type": "DistributedSlotSparseEmbeddingHash",
                    "bottom": f"data{t}",
                    "top": f"sparse_embedding{t}",
                    "sparse_embedding_hparam": {
                        "max_vocabulary_size_per_gpu": spec.rows,
                        "embedding_vec_size": spec.vec_size,
                        "combiner": spec.combiner,
                    },
                },
                [],
            )
        )
    fc = 0

    def mlp(seq: nn.Sequential, bottom: str) -> str:
        nonlocal fc
        for m in seq:
            if isinstance(m, nn.Linear):
                fc += 1
                top = f"fc{fc}"
                w = m.weight.detach().cpu().numpy().astype(np.float32)
                b = m.bias.detach().cpu().numpy().astype(np.float32)
                out.append(
                    (
                        {
                            "name": top,
                            "type": "InnerProduct",
                            "bottom": bottom,
                            "top": top,
                            "fc_param": {"num_output": int(m.out_features)},
                        },
                        [np.ascontiguousarray(w.T), b],
                    )
                )  # HugeCTR: W [in, out], then b
            elif isinstance(m, nn.ReLU):
                top = f"relu{fc}"
                out.append(({"name": top, "type": "ReLU", "bottom": bottom, "top": top}, []))
            else:  # pragma: no cover - DenseArch only builds the two
                raise TypeError(f"no HugeCTR layer for {m!r}")
            bottom = top
        return bottom

    mlp_top = mlp(model.dense_arch.bottom, "dense")
    emb = "sparse_embedding0"
    if len(cfg.tables) > 1:
        emb = "concat_embedding"
        out.append(
            (
                {
                    "name": emb,
                    "type": "Concat",
                    "axis": 1,
                    "bottom": [f"sparse_embedding{t}" for t in range(len(cfg.tables))],
                    "top": emb,
                },
                [],
            )
        )
    out.append(
        (
            {
                "name": "interaction1",
                "type": "Interaction",
                "bottom": [mlp_top, emb],
                "top": "interaction1",
            },
            [],
        )
    )
    last = mlp(model.dense_arch.top, "interaction1")
    out.append(
        (
            {
                "name": "loss",
                "type": "BinaryCrossEntropyLoss",
                "bottom": [last, "label"],
                "top": "loss",
            },
            [],
        )
    )
    return out


def network_json(model: DLRM) -> Dict:
    """HugeCTR network JSON (``{"layers": [...]}``) of ``model``."""
    return {"layers": [layer for layer, _ in hugectr_layers(model)]}


def dense_params(model: DLRM) -> np.ndarray:
    """The HugeCTR dense file's content: float32 parameters in network-JSON order."""
    parts = [p.reshape(-1) for _, params in hugectr_layers(model) for p in params]
    return np.concatenate(parts).astype("<f4")


def export_onnx(model: DLRM, path: str, opset: int = 17) -> None:
    """The dense part as ONNX: inputs ``dense``, ``emb_<t>``; output ``prob``; dynamic batch."""
    cfg = model.config
    arch = model.dense_arch.eval()
    example = (torch.zeros(2, cfg.dense_dim),) + tuple(
        torch.zeros(2, t.slot_num, t.vec_size) for t in cfg.tables
    )
    names = ["dense"] + [f"emb_{t}" for t in range(len(cfg.tables))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            arch,
            example,
            path,
            input_names=names,
            output_names=["prob"],
            dynamic_axes={n: {0: "batch"} for n in names + ["prob"]},
            opset_version=opset,
            dynamo=False,
        )


def ps_entry(model: DLRM, name: str, rel_dir: str, max_batch_size: int = 1024) -> Dict:
    """The model's ``models[]`` entry for ps.json; paths are ``rel_dir``/file."""
    cfg = model.config

    def p(f):
        return os.path.join(rel_dir, f) if rel_dir not in ("", ".") else f

    return {
        "model": name,
        "sparse_files": [p(f"{name}{t}_sparse_0.model") for t in range(len(cfg.tables))],
        "dense_file": p(f"{name}_dense_0.model"),
        "network_file": p(f"{name}.json"),
        "embedding_table_names": [t.name for t in cfg.tables],
        "embedding_vecsize_per_table": [t.vec_size for t in cfg.tables],
        "maxnum_catfeature_query_per_table_per_sample": [
            t.max_feature_num_per_sample for t in cfg.tables
        ],
        "default_value_for_each_table": [0.0] * len(cfg.tables),
        "label_dim": 1,
        "slot_num": cfg.total_slots,
        "deployed_device_list": [0],
        "max_batch_size": max_batch_size,
        "gpucache": True,
        "gpucacheper": 0.5,
        "hit_rate_threshold": 0.9,
    }


def export(
    model: DLRM,
    out_dir: str,
    name: str = "dlrm",
    ps_root: Optional[str] = None,
    meta_extra: Optional[Dict] = None,
    onnx: bool = True,
) -> Dict:
    """Write every file of the model (see the module docstring) into ``out_dir``.

    Args:
        ps_root: directory the ps.json entry's paths are relative to (default: the
            grandparent of ``out_dir``, i.e. the repository of ``<repo>/<model>/<version>``).
        meta_extra: more entries for the meta JSON (seed, metrics, ...).
        onnx: also write the ONNX file.

    Returns:
        The ps.json entry.
    """
    os.makedirs(out_dir, exist_ok=True)
    model = model.eval()
    for t, bag in enumerate(model.embedding_bags.values()):
        write_sparse_dir(
            os.path.join(out_dir, f"{name}{t}_sparse_0.model"),
            model.table_keys(t),
            bag.weight.detach().cpu().numpy(),
        )
    dense_params(model).tofile(os.path.join(out_dir, f"{name}_dense_0.model"))
    _write_json(os.path.join(out_dir, f"{name}.json"), network_json(model))
    if onnx:
        export_onnx(model, os.path.join(out_dir, f"{name}_dense.onnx"))
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        os.path.join(out_dir, f"{name}_torch.pt"),
    )
    root = (
        ps_root
        if ps_root is not None
        else os.path.dirname(os.path.dirname(os.path.abspath(out_dir)))
    )
    entry = ps_entry(model, name, os.path.relpath(os.path.abspath(out_dir), os.path.abspath(root)))
    n = len(model.config.tables)
    files = {
        "sparse": [f"{name}{t}_sparse_0.model" for t in range(n)],
        "dense": f"{name}_dense_0.model",
        "network": f"{name}.json",
        "onnx": f"{name}_dense.onnx" if onnx else None,
        "torch": f"{name}_torch.pt",
        "ps_entry": f"{name}_ps_entry.json",
    }
    meta = {
        "format": META_FORMAT,
        "name": name,
        **model.config.to_meta(),
        "total_slots": model.config.total_slots,
        "interaction_dim": model.config.interaction_dim,
        "dense_param_count": int(dense_params(model).size),
        "onnx_io": {"inputs": ["dense"] + [f"emb_{t}" for t in range(n)], "output": "prob"},
        "files": files,
        **(meta_extra or {}),
    }
    model.meta = meta
    _write_json(os.path.join(out_dir, f"{name}_meta.json"), meta)
    _write_json(os.path.join(out_dir, f"{name}_ps_entry.json"), entry)
    return entry


def train_and_export(
    out_dir: str,
    config: DLRMConfig = DEFAULT_CONFIG,
    settings: TrainSettings = TrainSettings(),
    name: str = "dlrm",
    ps_root: Optional[str] = None,
    onnx: bool = True,
    log=None,
) -> Tuple[TrainResult, Dict]:
    """What ``train.py`` does: :func:`train`, then :func:`export` with the metrics in the
    meta JSON. Returns the training result and the ps.json entry."""
    t0 = time.perf_counter()
    result = train(config, settings, log=log)
    t1 = time.perf_counter()
    entry = export(
        result.model,
        out_dir,
        name=name,
        ps_root=ps_root,
        onnx=onnx,
        meta_extra={
            "seed": settings.seed,
            "train_settings": asdict(settings),
            "hidden_model": {
                "latent_dim": HiddenModel.LATENT,
                "interacting_slots": result.truth.pairs,
            },
            "eval": result.metrics,
        },
    )
    result.metrics["export_seconds"] = round(time.perf_counter() - t1, 3)
    result.metrics["total_seconds"] = round(time.perf_counter() - t0, 3)
    return result, entry


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
