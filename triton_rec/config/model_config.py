"""Checks of a Triton ``config.pbtxt`` (as the JSON that Triton hands to ``initialize``).

Pure Python, so the rules are unit-tested without a server; the backends call these
once in ``initialize`` and fail the load with the model and field named.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, overload

from triton_rec import _native
from triton_rec.errors import ConfigError

#: The keys of a response answered with the default value, by cause (our extension;
#: the causes of :data:`triton_rec.cache.cached_table.DEFAULT_CAUSES`, in that order):
#: response parameters of every ``hps``/``hugectr`` response, and optional outputs.
#: Defined in src/native/seam.hpp (the native backend sends the same).
DEFAULT_INFO: Tuple[str, ...] = tuple(_native.DEFAULT_INFO)

#: Optional INT32 outputs that carry the response parameters as tensors, for runtimes
#: whose Python backend cannot attach response parameters (Triton 2.51): HPS's
#: ``NumSample`` / ``DeviceID``, then :data:`DEFAULT_INFO`.
HPS_INFO_OUTPUTS = ("NumSample", "DeviceID") + DEFAULT_INFO

#: The request parameter that makes a request fetch every cache miss synchronously,
#: whatever ``hit_rate_threshold`` says (a bool, or the string "true"/"false").
#: Defined in src/native/seam.hpp (the native backend reads the same).
EXACT_PARAMETER: str = _native.EXACT_PARAMETER


def model_parameter(config: Dict[str, Any], key: str) -> Optional[str]:
    """``parameters { key: ... value { string_value: ... } }`` of config.pbtxt, or None."""
    value = (config.get("parameters") or {}).get(key)
    if isinstance(value, dict):
        value = value.get("string_value")
    return value or None


def _io(config: Dict[str, Any], kind: str) -> List[Dict[str, Any]]:
    return list(config.get(kind) or [])


#: Largest config.pbtxt ``max_batch_size`` a model may declare (samples per request).
MAX_BATCH_SIZE_LIMIT = 1 << 20


def check_max_batch_size(config: Dict[str, Any]) -> int:
    """config.pbtxt ``max_batch_size``: an integer in 0..:data:`MAX_BATCH_SIZE_LIMIT`
    (ConfigError naming the model and the field otherwise)."""
    name = config.get("name", "?")
    value = config.get("max_batch_size", 0)
    try:
        ok = float(value) == int(value) and 0 <= int(value) <= MAX_BATCH_SIZE_LIMIT
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ConfigError(
            f"model '{name}' config.pbtxt: max_batch_size must be an integer from 0 to "
            f"{MAX_BATCH_SIZE_LIMIT}, got {value!r}"
        )
    return int(value)


def _check_inputs(config: Dict[str, Any], expected: Dict[str, Tuple[str, ...]]) -> str:
    """Exactly the ``expected`` inputs, each of one of its allowed types (and a sane
    ``max_batch_size``); the model name."""
    name = config.get("name", "?")
    check_max_batch_size(config)
    inputs = {i["name"]: i for i in _io(config, "input")}
    for inp, dtypes in expected.items():
        allowed = " or ".join(dtypes)
        if inp not in inputs:
            raise ConfigError(f"model '{name}' config.pbtxt: missing input '{inp}' ({allowed})")
        if inputs[inp].get("data_type") not in dtypes:
            raise ConfigError(
                f"model '{name}' config.pbtxt: input '{inp}' must be {allowed}, "
                f"got {inputs[inp].get('data_type')}"
            )
    extra = sorted(set(inputs) - set(expected))
    if extra:
        raise ConfigError(f"model '{name}' config.pbtxt: unexpected inputs {extra}")
    return name


def check_dense_model_config(config: Dict[str, Any]) -> str:
    """Validate a ``dense`` model's config: a sane ``max_batch_size`` and one TYPE_FP32
    output (the predictions; its inputs are checked by its requests). Returns its name."""
    name = config.get("name", "?")
    check_max_batch_size(config)
    outputs = config.get("output") or []
    if len(outputs) != 1 or outputs[0].get("data_type") != "TYPE_FP32":
        raise ConfigError(f"model '{name}' config.pbtxt: expected one TYPE_FP32 output")
    return outputs[0]["name"]


def check_hps_model_config(config: Dict[str, Any]) -> Tuple[str, Tuple[str, ...]]:
    """Validate the inputs/outputs of an ``hps`` model.

    Returns ``(embedding output name, declared info outputs)``.

    Raises:
        ConfigError: naming the model and the offending input/output.
    """
    name = _check_inputs(config, {"KEYS": ("TYPE_INT64",), "NUMKEYS": ("TYPE_INT32",)})
    outputs = _io(config, "output")
    info = _info_outputs(name, outputs)
    main = [o for o in outputs if o["name"] not in HPS_INFO_OUTPUTS]
    if len(main) != 1:
        raise ConfigError(
            f"model '{name}' config.pbtxt: expected exactly one embedding output, "
            f"got {[o['name'] for o in main]}"
        )
    if main[0].get("data_type") != "TYPE_FP32":
        raise ConfigError(
            f"model '{name}' config.pbtxt: output '{main[0]['name']}' must be TYPE_FP32, "
            f"got {main[0].get('data_type')}"
        )
    return main[0]["name"], info


def check_hugectr_model_config(config: Dict[str, Any]) -> Tuple[str, Tuple[str, ...]]:
    """Validate the inputs/outputs of a ``hugectr`` (whole model) config.

    Inputs ``DES`` (TYPE_FP32), ``CATCOLUMN`` (TYPE_UINT32 or TYPE_INT64), ``ROWINDEX``
    (TYPE_INT32); one TYPE_FP32 output (predictions) and optionally the INT32 outputs
    ``NumSample`` / ``DeviceID`` (:data:`HPS_INFO_OUTPUTS`). Returns ``(prediction output
    name, declared info outputs)``.
    """
    name = _check_inputs(
        config,
        {
            "DES": ("TYPE_FP32",),
            "CATCOLUMN": ("TYPE_UINT32", "TYPE_INT64"),
            "ROWINDEX": ("TYPE_INT32",),
        },
    )
    info = _info_outputs(name, _io(config, "output"))
    outputs = [o for o in _io(config, "output") if o["name"] not in HPS_INFO_OUTPUTS]
    if len(outputs) != 1 or outputs[0].get("data_type") != "TYPE_FP32":
        raise ConfigError(
            f"model '{name}' config.pbtxt: expected one TYPE_FP32 output, got "
            f"{[(o['name'], o.get('data_type')) for o in outputs]}"
        )
    return outputs[0]["name"], info


def _info_outputs(name: str, outputs: List[Dict[str, Any]]) -> Tuple[str, ...]:
    """The declared :data:`HPS_INFO_OUTPUTS` (each must be TYPE_INT32)."""
    for o in outputs:
        if o["name"] in HPS_INFO_OUTPUTS and o.get("data_type") != "TYPE_INT32":
            raise ConfigError(
                f"model '{name}' config.pbtxt: output '{o['name']}' must be TYPE_INT32"
            )
    return tuple(o["name"] for o in outputs if o["name"] in HPS_INFO_OUTPUTS)


_MAXNUM = "maxnum_catfeature_query_per_table_per_sample"

#: config.pbtxt parameters of NVIDIA's HugeCTR backend (hugectr_backend src/hugectr.cc,
#: ParseModelConfig L1156-1398) that change nothing on this node, and why.
HUGECTR_IGNORED_PARAMETERS = {
    "max_nnz": "unused by the HugeCTR backend too (parsed, never read)",
    "embedding_vector_size": "not used for inference by the HugeCTR backend either (its DCN "
    "and DeepFM samples say 32 for 16- and 11-float tables); ps.json's vector sizes count",
    "mixed_precision": "fp16 dense layers on the GPU; here the parameter dense_math (fp16, "
    "tf32) opts a KIND_GPU instance in",
}


def hugectr_cache_parameters(config: Dict[str, Any], params):
    """``params`` (a ModelParams) with the cache parameters of config.pbtxt applied as the
    HugeCTR backend applies them (src/hugectr.cc L1297-1363): ``gpucache`` must equal
    ps.json's; ``gpucacheper`` and ``hit_rate_threshold`` may only lower ps.json's values
    and then replace them. ConfigError names a contradiction."""
    import dataclasses

    model = params.model
    gpucache = model_flag(config, "gpucache", params.gpucache)
    if gpucache != params.gpucache:
        raise ConfigError(
            f"model '{model}' config.pbtxt: gpucache is {str(gpucache).lower()} but ps.json "
            f"says {str(params.gpucache).lower()} (the HugeCTR backend requires them equal)"
        )
    over = {}
    for key in ("gpucacheper", "hit_rate_threshold"):
        value = _number_parameter(config, key, float, lambda x: x >= 0, "a number >= 0")
        if value is None or not gpucache:
            continue
        if value > getattr(params, key):
            raise ConfigError(
                f"model '{model}' config.pbtxt: {key} {value} is above ps.json's "
                f"{getattr(params, key)} (the HugeCTR backend allows only a lower value)"
            )
        over[key] = value
    return dataclasses.replace(params, **over)


def check_hugectr_parameters(
    config: Dict[str, Any],
    model: str,
    *,
    dense_dim: int,
    slots: int,
    label_dim: int,
    keys_per_sample: int,
    paths: Mapping[str, Tuple[str, ...]],
    model_dir: str,
) -> Tuple[str, ...]:
    """Check the HugeCTR backend's config.pbtxt parameters against what the network and
    ps.json say (src/hugectr.cc L1203-1381): each that is given must agree; ConfigError
    names the parameter, both values and where the other one comes from. Returns the load
    log lines for parameters that have no effect here (:data:`HUGECTR_IGNORED_PARAMETERS`).

    ``paths``: ``{"sparse_files": (...), "dense_file": (...)}`` as ps.json resolves them;
    the parameters of those names (comma-separated, relative to ``model_dir``) may only
    name the same files."""
    where = f"model '{model}' config.pbtxt"
    for key, actual, source in (
        ("des_feature_num", dense_dim, "the network's dense input"),
        ("slots", slots, "the network's slots (sum over its embedding inputs)"),
        ("label_dim", label_dim, "the network's label"),
        ("cat_feature_num", keys_per_sample, f"ps.json {_MAXNUM}"),
    ):
        given = _number_parameter(config, key, int, lambda x: x >= 1, "an integer >= 1")
        if given is not None and given != actual:
            raise ConfigError(f"{where}: {key} is {given} but {source} gives {actual}")
    long_keys = model_flag(config, "embeddingkey_long_type", True)
    cat = next((i for i in _io(config, "input") if i["name"] == "CATCOLUMN"), {})
    if model_parameter(config, "embeddingkey_long_type") is not None and long_keys != (
        cat.get("data_type") == "TYPE_INT64"
    ):
        raise ConfigError(
            f"{where}: embeddingkey_long_type is {str(long_keys).lower()} but input "
            f"CATCOLUMN is {cat.get('data_type')}"
        )
    for key, expected in paths.items():
        given = model_parameter(config, key)
        if given is None:
            continue
        named = [os.path.join(model_dir, p.strip()) for p in given.split(",")]
        if [os.path.realpath(p) for p in named] != [os.path.realpath(p) for p in expected]:
            raise ConfigError(
                f"{where}: {key} {given!r} differs from ps.json's {', '.join(expected)}: "
                "name the files in ps.json only"
            )
    return tuple(
        f"{where}: parameter '{key}' has no effect here: {why}"
        for key, why in HUGECTR_IGNORED_PARAMETERS.items()
        if model_parameter(config, key) is not None
    )


def model_flag(config: Dict[str, Any], key: str, default: bool) -> bool:
    """A ``true``/``false`` string parameter of config.pbtxt (ConfigError otherwise)."""
    value = model_parameter(config, key)
    if value is None:
        return default
    if value.lower() not in ("true", "false"):
        raise ConfigError(f"config.pbtxt parameter '{key}' must be true or false, got {value!r}")
    return value.lower() == "true"


def _number_parameter(config: Dict[str, Any], key: str, convert, valid, what: str):
    """A string parameter of config.pbtxt parsed by ``convert`` and checked by ``valid``
    (None if absent; ConfigError naming ``what`` it must be if malformed)."""
    value = model_parameter(config, key)
    if value is None:
        return None
    try:
        number = convert(value)
    except ValueError:
        number = None
    if number is None or not valid(number):
        raise ConfigError(f"config.pbtxt parameter '{key}' must be {what}, got {value!r}")
    return number


@overload
def model_seconds(config: Dict[str, Any], key: str, default: float) -> float: ...
@overload
def model_seconds(config: Dict[str, Any], key: str, default: None) -> Optional[float]: ...


def model_seconds(config: Dict[str, Any], key: str, default: Optional[float]) -> Optional[float]:
    """A string parameter of config.pbtxt holding seconds >= 0 (``default`` if absent;
    ConfigError if malformed)."""
    seconds = _number_parameter(
        config, key, float, lambda x: 0.0 <= x < float("inf"), "seconds >= 0"
    )
    return default if seconds is None else seconds


def with_model_parameters(config: Dict[str, Any], params):
    """``params`` (a ModelParams) with what config.pbtxt's string parameters override, as
    in the HPS backend: ``refresh_interval``, ``refresh_delay`` (seconds, >= 0) and
    ``freeze_sparse`` (true/false). ConfigError names a malformed value."""
    import dataclasses

    over = {}
    for key in ("refresh_interval", "refresh_delay"):
        seconds = model_seconds(config, key, None)
        if seconds is not None:
            over[key] = seconds
    over["freeze_sparse"] = model_flag(config, "freeze_sparse", params.freeze_sparse)
    return dataclasses.replace(params, **over)


def model_count(config: Dict[str, Any], key: str) -> Optional[int]:
    """A string parameter of config.pbtxt holding an integer >= 1 (None if absent;
    ConfigError if malformed)."""
    return _number_parameter(config, key, int, lambda x: x >= 1, "an integer >= 1")


#: Environment variables that already size a process's BLAS/OpenMP pools; when one of
#: them is set (by the user or by whoever starts tritonserver), it replaces our default.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def instance_count(config: Dict[str, Any]) -> int:
    """Model instances on this node: the sum of ``instance_group[].count`` (Triton's
    default count is 1 per group, and one group when none is given)."""
    groups = config.get("instance_group") or [{}]
    return sum(int(g.get("count") or 1) for g in groups)


#: ``dense_math`` (config.pbtxt parameter) values: the arithmetic of a KIND_GPU instance's
#: dense layers (triton_rec.gpu.blas.CapturableCupy). ``fp32`` (the default; every KIND_CPU
#: instance); ``tf32``: float32 GEMMs on tensor cores with TF32-rounded inputs; ``fp16``: the
#: layers' GEMMs on fp16 copies of activations and weights, float32 accumulation. The
#: accuracy of each against fp32: docs/precision.md ("Reduced-precision dense layers").
DENSE_MATHS = ("fp32", "tf32", "fp16")


@dataclass(frozen=True)
class InstanceSettings:
    """The config.pbtxt parameters that shape how an instance runs (all backends).

    The defaults live here and only here.

    Args:
        metrics_interval: seconds between two publications of the instance's metrics by
            its background thread (``execute`` never publishes); 0: never published.
        intra_op_threads: threads of the instance's BLAS/OpenMP pools and of
            onnxruntime's intra-op pool. Every instance is its own process, so the
            rule is ``instances x intra_op_threads <= cores``.
        intra_op_source: where ``intra_op_threads`` came from (``config.pbtxt``, an
            environment variable's name, or ``default``), for the load log.
        dense_math: the arithmetic of a KIND_GPU instance's dense layers
            (:data:`DENSE_MATHS`).
    """

    metrics_interval: float = 1.0
    intra_op_threads: int = 1
    intra_op_source: str = "default"
    dense_math: str = "fp32"

    @classmethod
    def from_config(
        cls, config: Dict[str, Any], environ: Optional[Mapping[str, str]] = None
    ) -> InstanceSettings:
        """Read the parameters (ConfigError names a malformed one).

        ``intra_op_threads``: the config.pbtxt parameter if given, else the first of
        :data:`THREAD_ENV_VARS` set to an integer >= 1 in ``environ`` (default: this
        process's environment), else 1.
        """
        environ = os.environ if environ is None else environ
        threads, source = model_count(config, "intra_op_threads"), "config.pbtxt"
        if threads is None:
            threads, source = cls.intra_op_threads, "default"
            for var in THREAD_ENV_VARS:
                value = (environ.get(var) or "").strip()
                if value.isdigit() and int(value) >= 1:
                    threads, source = int(value), var
                    break
        math = model_parameter(config, "dense_math") or cls.dense_math
        if math not in DENSE_MATHS:
            raise ConfigError(
                f"config.pbtxt parameter 'dense_math' must be one of {', '.join(DENSE_MATHS)}, "
                f"got {math!r}"
            )
        return cls(
            metrics_interval=model_seconds(config, "metrics_interval", cls.metrics_interval),
            intra_op_threads=threads,
            intra_op_source=source,
            dense_math=math,
        )

    def oversubscribes(self, config: Dict[str, Any]) -> bool:
        """Whether ``instances x intra_op_threads`` exceeds the cores this process may use."""
        return instance_count(config) * self.intra_op_threads > usable_cores()

    def describe(self, config: Dict[str, Any]) -> str:
        """One line for the load log: the thread count, where it came from, and how it
        fits the node (``instances x threads`` against the usable cores)."""
        n = instance_count(config)
        fits = "OVERSUBSCRIBED" if self.oversubscribes(config) else "fits"
        return (
            f"intra_op_threads={self.intra_op_threads} ({self.intra_op_source}); "
            f"{n} instances x {self.intra_op_threads} threads on {usable_cores()} cores: {fits}; "
            f"metrics every {self.metrics_interval:g} s"
        )


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
