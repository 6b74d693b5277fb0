"""Which onnxruntime kernels exist, per provider, op, opset and element type.

Stdlib only. The data is ``amp_rewrite/data/ort_kernels.json``: the onnxruntime 1.31.1 kernel
registry (the table ``docs/OperatorKernels.md`` is generated from), one row per
(domain, op, inclusive opset range) with the element types of every type constraint, plus
``onnx_schemas``, the tensor types each op schema version allows.

Why this module exists: a rule that puts an op in low precision is only safe on a provider that
has a low-precision kernel for it at the model's opset. Otherwise onnxruntime either fails to
load the model or silently places the node on another provider. Rule files are checked against
this table (tests/test_rules_kernels.py), and the painter asks it before keeping an op low.

Domains are spelled as in ONNX models: ``""`` (or ``"ai.onnx"``) is the default domain.
Element types are spelled as in the JSON: ``float``, ``float16``, ``bfloat16``, ``double``, ...
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any, Iterable

ONNX_DOMAIN = "ai.onnx"
FLOAT = "float"

_PROVIDER_ALIASES = {
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}

Row = dict[str, Any]


@functools.lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    """The parsed JSON, read once per process (it is ~1 MB and never changes at run time)."""
    text = resources.files("amp_rewrite.data").joinpath("ort_kernels.json").read_text("utf-8")
    return json.loads(text)


def table_version() -> str:
    """The onnxruntime version the table was read from, for reports."""
    return str(_table().get("onnxruntime_version_or_commit", "unknown"))


def canonical_domain(domain: str | None) -> str:
    """The JSON's spelling of a domain: ONNX writes the default domain as ``""``."""
    return ONNX_DOMAIN if domain in (None, "", ONNX_DOMAIN) else domain


def canonical_provider(provider: str) -> str:
    """Full execution-provider name; accepts the short forms ``cuda`` and ``cpu``."""
    return _PROVIDER_ALIASES.get(provider.lower(), provider)


def providers() -> list[str]:
    """Execution providers the table describes."""
    return sorted(_table()["providers"])


def knows_provider(provider: str) -> bool:
    """Whether the table describes ``provider``; the queries raise KeyError for any other."""
    return canonical_provider(provider) in _table()["providers"]


@functools.lru_cache(maxsize=None)
def _rows_by_op(provider: str) -> dict[tuple[str, str], tuple[Row, ...]]:
    """Rows of one provider indexed by (domain, op): lookups are in hot loops of the tests."""
    all_rows = _table()["providers"].get(provider)
    if all_rows is None:
        known = ", ".join(providers())
        raise KeyError(f"unknown execution provider {provider!r} (known: {known})")
    index: dict[tuple[str, str], list[Row]] = {}
    for row in all_rows:
        index.setdefault((row["domain"], row["op"]), []).append(row)
    return {key: tuple(rows) for key, rows in index.items()}


def _covers(row: Row, opset: int) -> bool:
    until = row["until"]
    return row["since"] <= opset and (until is None or opset <= until)


def _row_types(row: Row) -> set[str]:
    """Plain tensor element types of a row, over all its type constraints.

    Kernels registered without type constraints (CUDA NonMaxSuppression) carry the schema's
    types instead. Sequence/optional/map types are dropped: they are never painted.
    """
    if row.get("untyped_kernel"):
        types: Iterable[str] = row.get("schema_types") or ()
    else:
        types = (t for constraint in row["type_constraints"].values() for t in constraint)
    return {t for t in types if "(" not in t}


def kernel_rows(provider: str, op: str, opset: int, domain: str = "") -> list[Row]:
    """Rows of ``provider`` for ``op`` whose opset range covers ``opset``.

    Several rows can cover one opset (CUDA ThresholdedRelu has 1+ and 10+): callers take the union.
    """
    rows = _rows_by_op(canonical_provider(provider)).get((canonical_domain(domain), op), ())
    return [row for row in rows if _covers(row, opset)]


@functools.lru_cache(maxsize=4096)
def kernel_types(provider: str, op: str, opset: int, domain: str = "") -> frozenset[str]:
    """Union of element types the provider's kernels for ``op`` accept at ``opset``.

    Cached: classify asks for every node, and a model has few distinct (op, opset) pairs."""
    types: set[str] = set()
    for row in kernel_rows(provider, op, opset, domain):
        types |= _row_types(row)
    return frozenset(types)


def has_kernel(provider: str, op: str, opset: int, dtype: str, domain: str = "") -> bool:
    """Whether ``provider`` registers a kernel for ``op`` at ``opset`` accepting ``dtype``."""
    return dtype in kernel_types(provider, op, opset, domain)


def op_has_float_kernel(provider: str, op: str, opset: int, domain: str = "") -> bool:
    """Whether the op runs in FP32 on the provider at that opset: the baseline a rewrite keeps."""
    return has_kernel(provider, op, opset, FLOAT, domain)


def low_precision_gap(provider: str, op: str, opset: int, dtype: str, domain: str = "") -> bool:
    """True when the op has a float kernel but none for ``dtype``: putting it low would break."""
    types = kernel_types(provider, op, opset, domain)
    return FLOAT in types and dtype not in types


@functools.lru_cache(maxsize=None)
def _known_ops(domain: str) -> frozenset[str]:
    names = set(_table().get("onnx_schemas", {}).get("domains", {}).get(domain, {}))
    for provider in providers():
        names.update(op for (dom, op) in _rows_by_op(provider) if dom == domain)
    return frozenset(names)


def known_ops(domain: str = "") -> set[str]:
    """Op names of ``domain`` that the table knows (op schemas plus kernel rows of any provider)."""
    return set(_known_ops(canonical_domain(domain)))


def schema_allows(op: str, opset: int, dtype: str, domain: str = "") -> bool | None:
    """Whether the op schema in force at ``opset`` allows ``dtype`` anywhere.

    Tells an execution-provider gap (schema allows it, no kernel) from a spec limit (the model
    would need a Cast anyway). None when the table has no schema for the op at that opset.
    """
    versions = _table().get("onnx_schemas", {}).get("domains", {})
    versions = versions.get(canonical_domain(domain), {}).get(op) or []
    in_force = [v for v in versions if v["since"] <= opset]
    if not in_force:
        return None
    return dtype in max(in_force, key=lambda v: v["since"])["types"]
