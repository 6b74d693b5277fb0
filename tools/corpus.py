"""Corpus of FP32 ONNX models that the AMP rewriter is tested against.

The models are *built* (exported / generated) at test time rather than
downloaded: the CI machines have no network access to model hubs, and building
from configs with seeded random weights keeps the corpus reproducible and
small.  Every model comes with deterministic feeds and the names of the
outputs worth comparing, so a test can run the FP32 original and the
rewritten model side by side.

Families:
  * ``zoo/*``       the nine "light" model-zoo CNNs shipped inside the onnx
                    package (opset 9, IR 3, caffe2 exports), with their
                    constant placeholder weights replaced by seeded He-init
                    weights and BatchNorm statistics calibrated on the feed,
                    so activations neither vanish nor explode.
  * ``hf/*``        tiny HuggingFace transformers (random weights, built from
                    configs) exported by the TorchScript exporter at opsets
                    13/17 and by the dynamo exporter at opset 18.
  * ``torchnn/*``   small torch.nn networks: LSTM, GroupNorm UNet, BN ResNet.
  * ``control/*``   hand-written If / Loop models (onnx.parser text).
  * ``synthetic/*`` hand-written transformer block and CNN (onnx.parser).

Builds are cached on disk (``$AMP_REWRITE_CORPUS_CACHE`` or
``~/.cache/amp-rewrite-corpus``) keyed by model name, the versions of the
libraries that shape the export, and a hash of this file, so a second test run
only loads files.

Usage::

    from tools.corpus import build, list_models
    for name in list_models("fast"):
        cm = build(name)   # CorpusModel(name, model, feeds, family, logits, ...)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["CorpusModel", "build", "build_uncached", "list_models", "cache_dir", "MAX_IR_VERSION"]

#: onnxruntime 1.31 refuses IR > 10 (onnx 1.23's helpers default to IR 14 ... ).
MAX_IR_VERSION = 10
_TIERS = ("fast", "full")


@dataclasses.dataclass
class CorpusModel:
    """One FP32 model of the corpus together with what is needed to run and judge it.

    Attributes:
        name: registry name, e.g. ``"hf/bert-torchscript-op13"``.
        model: the FP32 model (``ir_version`` <= 10 so onnxruntime loads it).
        feeds: deterministic inputs (token ids within the vocabulary, 0/1
            attention masks, ~N(0, 1) images and features).
        family: ``"zoo"``, ``"hf"``, ``"torchnn"``, ``"control"`` or ``"synthetic"``.
        logits: output names to compare with a relative tolerance.
        exporter: ``"dynamo"``, ``"torchscript"``, ``"onnx-parser"`` or
            ``"onnx-caffe2"`` (the zoo models' original producer).
        opset: default-domain opset version of ``model``.
        path: a file on disk holding ``model`` as built (the cache entry), so
            large models can be handed to onnxruntime without re-serialising;
            ``None`` when built uncached.  Stale once ``model`` is mutated.
    """

    name: str
    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    family: str
    logits: list[str]
    exporter: str
    opset: int
    path: str | None = None


# =========================================================================== #
# registry
# =========================================================================== #
_Builder = Callable[[], CorpusModel]
_REGISTRY: dict[str, tuple[_Builder, bool]] = {}  # name -> (builder, in fast tier)


def _register(name: str, builder: _Builder, *, fast: bool = False) -> None:
    if name in _REGISTRY:
        raise ValueError(f"duplicate corpus model {name!r}")
    _REGISTRY[name] = (builder, fast)


def list_models(tier: str = "fast") -> list[str]:
    """Names of the models in ``tier``: ``"fast"`` (quick subset) or ``"full"`` (everything)."""
    if tier not in _TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {_TIERS}")
    return [n for n, (_, fast) in _REGISTRY.items() if tier == "full" or fast]


def build_uncached(name: str) -> CorpusModel:
    """Build ``name`` from scratch (no disk cache); the result is normalised and checked."""
    try:
        builder, _ = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown corpus model {name!r}; see list_models('full')") from None
    cm = builder()
    _normalise(cm)
    return cm


def build(name: str) -> CorpusModel:
    """Build ``name``, or load it from the on-disk cache when an identical build exists.

    An unwritable cache is not an error: the model is returned uncached
    (``path`` is then ``None``).
    """
    entry = cache_dir() / _safe_name(name)
    if (entry / _META).exists():
        return _load(entry)
    cm = build_uncached(name)
    try:
        _store(entry, cm)
    except OSError as exc:
        warnings.warn(f"corpus cache not written ({exc}); {name} will be rebuilt next time", stacklevel=2)
        return cm
    cm.path = str(entry / _MODEL)
    return cm


def _normalise(cm: CorpusModel) -> None:
    """Enforce the corpus invariants every consumer relies on."""
    if cm.model.ir_version > MAX_IR_VERSION:
        cm.model.ir_version = MAX_IR_VERSION
    outputs = {o.name for o in cm.model.graph.output}
    missing = [n for n in cm.logits if n not in outputs]
    if missing:
        raise AssertionError(f"{cm.name}: logits {missing} are not graph outputs {sorted(outputs)}")
    cm.opset = _default_opset(cm.model)


def _default_opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _seed(key: str) -> int:
    """A stable per-name seed (``hash()`` is salted per process, crc32 is not)."""
    return zlib.crc32(key.encode())


# =========================================================================== #
# disk cache
# =========================================================================== #
_META, _MODEL, _FEEDS = "meta.json", "model.onnx", "feeds.npz"
_VERSIONED_PACKAGES = ("torch", "transformers", "onnx", "onnxscript", "numpy")


@functools.lru_cache(maxsize=None)
def _version_key() -> str:
    """Everything that can change a build: library versions and this file's source."""
    parts = []
    for pkg in _VERSIONED_PACKAGES:
        try:
            parts.append(f"{pkg}{metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{pkg}-none")
    src = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    return hashlib.sha256("-".join(parts).encode()).hexdigest()[:12] + "-" + src


def cache_dir() -> Path:
    """The cache directory of the current library versions and corpus source."""
    root = os.environ.get("AMP_REWRITE_CORPUS_CACHE") or Path.home() / ".cache" / "amp-rewrite-corpus"
    return Path(root) / _version_key()


def _safe_name(name: str) -> str:
    return name.replace("/", "__")


def _store(entry: Path, cm: CorpusModel) -> None:
    """Write the entry into a temp dir, then rename it into place (atomic).

    Concurrent builders of the same model race harmlessly: the loser's rename
    fails because the directory exists, and its copy is discarded.
    """
    entry.parent.mkdir(parents=True, exist_ok=True)
    _prune_stale(entry.parent)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        with open(tmp / _MODEL, "wb") as f:
            f.write(cm.model.SerializeToString())
        names = list(cm.feeds)
        np.savez(tmp / _FEEDS, **{f"a{i}": cm.feeds[n] for i, n in enumerate(names)})
        meta = {"name": cm.name, "family": cm.family, "logits": cm.logits,
                "exporter": cm.exporter, "opset": cm.opset, "feeds": names}
        (tmp / _META).write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / _META).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_STALE_AFTER_S = 3600


def _prune_stale(current: Path) -> None:
    """Delete other cache generations (each can hold ~1.4 GB of zoo weights) that
    have not been written to for an hour, i.e. are no longer in use."""
    now = time.time()
    for sibling in current.parent.iterdir():
        if (sibling.is_dir() and sibling != current and not sibling.name.startswith(".")
                and now - sibling.stat().st_mtime > _STALE_AFTER_S):
            shutil.rmtree(sibling, ignore_errors=True)


def _load(entry: Path) -> CorpusModel:
    meta = json.loads((entry / _META).read_text())
    with np.load(entry / _FEEDS, allow_pickle=False) as data:
        feeds = {n: data[f"a{i}"] for i, n in enumerate(meta["feeds"])}
    model = onnx.load(entry / _MODEL)
    return CorpusModel(name=meta["name"], model=model, feeds=feeds, family=meta["family"],
                       logits=meta["logits"], exporter=meta["exporter"], opset=meta["opset"],
                       path=str(entry / _MODEL))


# =========================================================================== #
# shared helpers
# =========================================================================== #
@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence exporter chatter (progress prints, deprecation and tracer warnings).

    Exceptions still propagate with their full message; only stdout/stderr
    noise and warnings are swallowed.
    """
    loggers = [logging.getLogger(n) for n in ("torch", "torch.onnx", "torch.export", "onnxscript",
                                              "transformers", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    tf_logging = None
    if "transformers" in sys.modules:  # never import it just to silence it
        from transformers.utils import logging as tf_logging

        tf_level = tf_logging.get_verbosity()
        tf_logging.set_verbosity_error()
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if tf_logging is not None:
            tf_logging.set_verbosity(tf_level)


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, order="C"), name)  # keeps 0-d scalars 0-d


def _parse_with_weights(text: str, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Parse ONNX text and attach ``weights`` as initializers.

    Weights are attached after parsing because writing hundreds of random
    floats into the text would make it unreadable.
    """
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend(_init(n, a) for n, a in weights.items())
    return model


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= np.float32(std)  # in place: the zoo's FC layers hold up to 100M floats
    return out


def _he(rng: np.random.Generator, fan_in: int, *shape: int) -> np.ndarray:
    """He-normal init: keeps activation variance ~constant through ReLU layers."""
    return _normal(rng, shape, np.sqrt(2.0 / fan_in))


def _token_feeds(rng: np.random.Generator, batch: int, seq: int, vocab: int,
                 *, low: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Token ids within ``[low, vocab)`` (below ``low``: special tokens) and a 0/1
    mask whose last row is right-padded, so masking paths are exercised."""
    ids = rng.integers(low, vocab, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[-1, seq * 3 // 4:] = 0
    return ids, mask


# =========================================================================== #
# zoo: the onnx package's light model-zoo CNNs with random weights
# =========================================================================== #
_ZOO = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
        "shufflenet", "squeezenet", "vgg19", "zfnet512")
#: Small and quick (~6 MB of weights, < 0.1 s in onnxruntime): in the fast tier.
_ZOO_FAST = ("squeezenet", "shufflenet")
_PASS_THROUGH = ("Unsqueeze", "Reshape", "Identity", "Cast")


def _zoo_path(name: str) -> Path:
    return Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"light_{name}.onnx"


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    out: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for node in graph.node:
        for i, name in enumerate(node.input):
            out[name].append((node, i))
    return out


def _final_use(name: str, consumers: dict) -> tuple[str, int, onnx.NodeProto | None]:
    """The first real consumer (op type, input index) of a weight, looking through reshapes."""
    for _ in range(4):
        uses = consumers.get(name, [])
        if not uses:
            return "", -1, None
        node, idx = uses[0]
        if node.op_type not in _PASS_THROUGH:
            return node.op_type, idx, node
        name = node.output[0]
    return "", -1, None


def _random_weight(rng: np.random.Generator, shape: tuple[int, ...], use: tuple) -> np.ndarray:
    """Seeded weights scaled by role, so a random network behaves like a trained one statistically."""
    op, idx, node = use
    if op == "Conv" and idx == 1:
        return _he(rng, int(np.prod(shape[1:])), *shape)
    if op == "Gemm" and idx == 1:
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return _he(rng, shape[1] if trans_b else shape[0], *shape)
    if op == "BatchNormalization":
        # scale ~1, shift ~0; mean/var are placeholders until _calibrate.
        base = {1: 1.0, 2: 0.0, 3: 0.0, 4: 1.0}[idx]
        jitter = 0.1 if idx in (1, 2) else 0.0
        return base + _normal(rng, shape, jitter)
    if op == "Mul":  # caffe2 "Scale" layers after BN
        return 1.0 + _normal(rng, shape, 0.1)
    return _normal(rng, shape, 0.05)  # biases and anything else


def _randomise_zoo_weights(model: onnx.ModelProto, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Replace the light models' ConstantOfShape placeholders and float initializers
    with seeded random weights, returned as arrays.

    The model keeps IR 3 / opset 9 semantics: at IR < 4 every initializer
    must also be a graph input, so each weight gets a graph input here; the
    caller attaches the (calibrated) arrays as initializers afterwards.
    """
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    weights: dict[str, tuple[int, ...]] = {}
    shape_inputs: set[str] = set()
    kept_nodes = []
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            weights[node.output[0]] = tuple(int(d) for d in numpy_helper.to_array(inits[node.input[0]]))
            shape_inputs.add(node.input[0])
        else:
            kept_nodes.append(node)
    for t in graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT:
            weights[t.name] = tuple(t.dims)
    del graph.node[:]
    graph.node.extend(kept_nodes)

    consumers = _consumers(graph)
    used = set(consumers)
    drop = shape_inputs | set(weights) | {n for n in inits if n not in used}
    keep_inits = [t for t in graph.initializer if t.name not in drop]
    keep_inputs = [i for i in graph.input if i.name not in drop]
    del graph.initializer[:]
    del graph.input[:]
    graph.initializer.extend(keep_inits)
    graph.input.extend(keep_inputs)
    arrays = {}
    for name in sorted(weights):  # sorted: generation order must not depend on dict order
        if name not in used:
            continue
        arrays[name] = _random_weight(rng, weights[name], _final_use(name, consumers))
        graph.input.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, weights[name]))
    return arrays


def _calibrate(model: onnx.ModelProto, weights: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> None:
    """Data-dependent init: make every Conv/Gemm output unit-variance and every
    BatchNormalization normalise its actual input, exactly, in one onnxruntime run.

    Random weights alone let activations drift by orders of magnitude through
    50-120 layers (inception's logits saturate the softmax; a trained model's
    would not).  Calibrating layer by layer would need one run per layer, so a
    *probe* copy of the model computes the statistics in-graph instead: each
    Conv/Gemm output is divided by its own standard deviation and each BN is
    fed the batch mean/variance of its input.  The probe's forward pass is
    therefore exactly the calibrated network's, and the recorded statistics
    are folded back into ``weights`` in place (``W/s, b/s``; running stats).

    ``model`` declares the weights as graph inputs but does not hold them:
    the probe is fed the arrays, so hundreds of MB of weights are never
    serialised just to be measured.
    """
    import onnxruntime as ort

    probe, stats = _calibration_probe(model, set(weights))
    if not stats:
        return
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(probe.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    values = dict(zip(stats, sess.run(list(stats), {**feeds, **weights})))
    for out_name, (kind, targets) in stats.items():
        value = values[out_name]
        if kind == "std":  # divide weight and bias by the output's std
            for name in targets:
                weights[name] /= np.float32(value)
        else:  # running mean or running var of a BN
            weights[targets[0]] = value.astype(np.float32)


_VAR_FLOOR = 1e-3  # dead (all-zero) channels must not be amplified by 1/sqrt(eps)
_FLOOR_NAME = "calib_var_floor"


def _calibration_probe(model: onnx.ModelProto,
                       weights: set[str]) -> tuple[onnx.ModelProto, dict[str, tuple[str, list[str]]]]:
    """Build the probe described in :func:`_calibrate`.

    Returns the probe and ``{probe output: (kind, weights it sets)}``.  Only
    opset-9-level ops are used so the probe runs at the model's opset.
    """
    source = _weight_resolver(model.graph, weights)
    nodes: list[onnx.NodeProto] = []
    stats: dict[str, tuple[str, list[str]]] = {}
    for i, original in enumerate(model.graph.node):
        node = onnx.NodeProto()
        node.CopyFrom(original)
        tag = f"calib{i}"
        weight = source(node.input[1]) if node.op_type in ("Conv", "Gemm") else None
        has_bias = len(node.input) > 2 and bool(node.input[2])
        bias = source(node.input[2]) if has_bias else None
        if weight is not None and (bias is not None or not has_bias):  # else W/s, b/s is not exact
            y = node.output[0]
            node.output[0] = f"{tag}_raw"
            nodes += [node, *_unit_variance_nodes(tag, node.output[0], y)]
            stats[f"{tag}_s"] = ("std", [n for n in (weight, bias) if n is not None])
        elif node.op_type == "BatchNormalization":
            nodes += _batch_stats_nodes(tag, node.input[0])
            stats[f"{tag}_mean"] = ("mean", [node.input[3]])
            stats[f"{tag}_var"] = ("var", [node.input[4]])
            node.input[3], node.input[4] = f"{tag}_mean", f"{tag}_var"
            nodes.append(node)
        else:
            nodes.append(node)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.node[:]
    probe.graph.node.extend(nodes)
    probe.graph.initializer.append(_init(_FLOOR_NAME, np.array(_VAR_FLOOR, np.float32)))
    probe.graph.input.append(helper.make_tensor_value_info(_FLOOR_NAME, onnx.TensorProto.FLOAT, []))
    probe.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in stats)
    return probe, stats


def _weight_resolver(graph: onnx.GraphProto, weights: set[str]) -> Callable[[str], str | None]:
    """``source(name)``: the weight behind ``name`` looking through reshapes, or
    None when it is computed or shared (then rescaling it would not be exact)."""
    uses = _consumers(graph)
    producers = {out: n for n in graph.node for out in n.output}

    def source(name: str) -> str | None:
        while name not in weights:
            node = producers.get(name)
            if node is None or node.op_type not in _PASS_THROUGH:
                return None
            name = node.input[0]
        return name if len(uses[name]) == 1 else None

    return source


def _unit_variance_nodes(tag: str, raw: str, out: str) -> list[onnx.NodeProto]:
    """``out = raw / std(raw)``, exposing the scalar std as ``{tag}_s``."""
    return [
        helper.make_node("ReduceMean", [raw], [f"{tag}_m"], keepdims=0),
        helper.make_node("Sub", [raw, f"{tag}_m"], [f"{tag}_d"]),
        helper.make_node("Mul", [f"{tag}_d", f"{tag}_d"], [f"{tag}_d2"]),
        helper.make_node("ReduceMean", [f"{tag}_d2"], [f"{tag}_v"], keepdims=0),
        helper.make_node("Max", [f"{tag}_v", _FLOOR_NAME], [f"{tag}_vf"]),
        helper.make_node("Sqrt", [f"{tag}_vf"], [f"{tag}_s"]),
        helper.make_node("Div", [raw, f"{tag}_s"], [out]),
    ]


def _batch_stats_nodes(tag: str, x: str) -> list[onnx.NodeProto]:
    """Per-channel mean ``{tag}_mean`` and (floored) variance ``{tag}_var`` of an NCHW ``x``
    (the zoo's BatchNormalizations are all 4-D)."""
    axes = [0, 2, 3]
    return [
        helper.make_node("ReduceMean", [x], [f"{tag}_mean"], axes=axes, keepdims=0),
        helper.make_node("ReduceMean", [x], [f"{tag}_mk"], axes=axes, keepdims=1),
        helper.make_node("Sub", [x, f"{tag}_mk"], [f"{tag}_d"]),
        helper.make_node("Mul", [f"{tag}_d", f"{tag}_d"], [f"{tag}_d2"]),
        helper.make_node("ReduceMean", [f"{tag}_d2"], [f"{tag}_v"], axes=axes, keepdims=0),
        helper.make_node("Max", [f"{tag}_v", _FLOOR_NAME], [f"{tag}_var"]),
    ]


def _build_zoo(name: str) -> CorpusModel:
    """A zoo CNN at its original 1x3x224x224 input, opset 9 and IR 3, with random weights."""
    key = f"zoo/{name}"
    model = onnx.load(_zoo_path(name))
    rng = np.random.default_rng(_seed(key))
    weights = _randomise_zoo_weights(model, rng)
    constants = set(weights) | {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name not in constants:  # the image input
            shape = [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]
            feeds[vi.name] = rng.standard_normal(shape, dtype=np.float32)
    _calibrate(model, weights, feeds)
    model.graph.initializer.extend(_init(n, a) for n, a in weights.items())
    return CorpusModel(name=key, model=model, feeds=feeds, family="zoo",
                       logits=[model.graph.output[0].name], exporter=model.producer_name or "onnx-zoo",
                       opset=_default_opset(model))


for _z in _ZOO:
    _register(f"zoo/{_z}", lambda _z=_z: _build_zoo(_z), fast=_z in _ZOO_FAST)


# =========================================================================== #
# torch export plumbing (hf/* and torchnn/*)
# =========================================================================== #
@dataclasses.dataclass
class _TorchCase:
    """A torch module ready for export: its forward's parameter names equal ``feeds``' keys."""

    module: object  # torch.nn.Module; typed loosely so torch stays a lazy import
    feeds: dict[str, np.ndarray]
    outputs: list[str]
    dynamic: dict[str, dict[int, str]]  # input -> {axis: symbolic dim name}
    max_dims: dict[str, int] = dataclasses.field(default_factory=dict)
    #: TorchScript folds eval-mode BatchNorm into the preceding Conv; True keeps
    #: the BatchNormalization nodes (exported in inference mode all the same).
    keep_batchnorm: bool = False


def _export_torch(case: _TorchCase, exporter: str, opset: int) -> onnx.ModelProto:
    """Export with the TorchScript (``dynamo=False``) or the dynamo exporter.

    Batch / sequence axes are exported as symbolic dims (named alike in both
    exporters) because real deployments have them and shape-dependent passes
    must cope with them.
    """
    import torch

    args = tuple(torch.from_numpy(a) for a in case.feeds.values())
    names = list(case.feeds)
    with _quiet(), torch.no_grad():
        if exporter == "torchscript":
            f = io.BytesIO()
            mode = torch.onnx.TrainingMode.PRESERVE if case.keep_batchnorm else torch.onnx.TrainingMode.EVAL
            torch.onnx.export(case.module, args, f, dynamo=False, opset_version=opset, training=mode,
                              input_names=names, output_names=case.outputs,
                              dynamic_axes=case.dynamic or None)
            return onnx.load_from_string(f.getvalue())
        if exporter == "dynamo":
            from torch.export import Dim

            dims: dict[str, object] = {}
            shapes = {}
            for inp in names:
                spec = {}
                for axis, dname in case.dynamic.get(inp, {}).items():
                    if dname not in dims:
                        dims[dname] = Dim(dname, max=case.max_dims.get(dname, 1024))
                    spec[axis] = dims[dname]
                shapes[inp] = spec or None
            prog = torch.onnx.export(case.module, args, dynamo=True, opset_version=opset,
                                     input_names=names, output_names=case.outputs,
                                     dynamic_shapes=shapes if dims else None, verbose=False)
            return prog.model_proto
    raise ValueError(f"unknown exporter {exporter!r}")


def _torch_model(name: str, family: str, make_case: Callable[[], _TorchCase],
                 exporter: str, opset: int) -> CorpusModel:
    """Instantiate (seeded by the architecture, so every exporter of an arch sees
    the same weights) and export one torch model."""
    import torch

    if family == "hf":
        import transformers  # noqa: F401 (imported before _quiet so its logging gets silenced)

    arch = make_case.__name__
    with torch.random.fork_rng(devices=[]), _quiet():  # leave the caller's torch RNG alone
        torch.manual_seed(_seed(arch))
        case = make_case()
        case.module.eval()
    model = _export_torch(case, exporter, opset)
    return CorpusModel(name=name, model=model, feeds=case.feeds, family=family,
                       logits=list(case.outputs), exporter=exporter, opset=opset)


def _hf_wrapper(model, input_names: list[str], pick: Callable):
    """Wrap an HF model so forward takes positional tensors and returns plain tensors.

    Exporters cannot return HF ``ModelOutput`` dataclasses, and the dynamo
    exporter reads forward's parameter names to match ``dynamic_shapes`` and
    name the graph inputs, so forward gets an explicit signature.
    """
    import inspect

    import torch

    class HFWrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args):
            return pick(self.model(**dict(zip(input_names, args))))

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    HFWrapper.forward.__signature__ = inspect.Signature(
        [inspect.Parameter(n, kind) for n in ("self", *input_names)])
    return HFWrapper()


# =========================================================================== #
# hf: tiny transformers, random weights, built from configs
# =========================================================================== #
_VOCAB, _HIDDEN, _HEADS, _FFN, _LAYERS = 256, 64, 4, 128, 2
_BATCH, _SEQ, _DEC_SEQ, _IMG = 2, 16, 8, 32
_TEXT_DYN = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
_SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _text_feeds(arch: str) -> dict[str, np.ndarray]:
    ids, mask = _token_feeds(np.random.default_rng(_seed(arch)), _BATCH, _SEQ, _VOCAB)
    return {"input_ids": ids, "attention_mask": mask}


def _image(arch: str, channels: int = 3) -> np.ndarray:
    rng = np.random.default_rng(_seed(arch + "/pixels"))
    return rng.standard_normal((_BATCH, channels, _IMG, _IMG), dtype=np.float32)


def _hf_bert() -> _TorchCase:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=_VOCAB, hidden_size=_HIDDEN, num_hidden_layers=_LAYERS,
                     num_attention_heads=_HEADS, intermediate_size=_FFN, max_position_embeddings=64,
                     num_labels=3, attn_implementation="eager", pad_token_id=0,
                     output_hidden_states=True)
    feeds = _text_feeds("bert")
    model = _hf_wrapper(BertForSequenceClassification(cfg), list(feeds),
                          lambda o: (o.logits, o.hidden_states[-1]))
    return _TorchCase(model, feeds, ["logits", "last_hidden_state"], dict(_TEXT_DYN), {"sequence": 64})


def _hf_gpt2() -> _TorchCase:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=_VOCAB, n_embd=_HIDDEN, n_layer=_LAYERS, n_head=_HEADS, n_positions=64,
                     use_cache=False, attn_implementation="eager", **_SPECIAL)
    feeds = _text_feeds("gpt2")
    model = _hf_wrapper(GPT2LMHeadModel(cfg), list(feeds), lambda o: o.logits)
    return _TorchCase(model, feeds, ["logits"], dict(_TEXT_DYN), {"sequence": 64})


def _hf_llama() -> _TorchCase:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=_VOCAB, hidden_size=_HIDDEN, intermediate_size=_FFN,
                      num_hidden_layers=_LAYERS, num_attention_heads=_HEADS, num_key_value_heads=2,
                      max_position_embeddings=64, use_cache=False, attn_implementation="eager", **_SPECIAL)
    feeds = _text_feeds("llama")
    model = _hf_wrapper(LlamaForCausalLM(cfg), list(feeds), lambda o: o.logits)
    return _TorchCase(model, feeds, ["logits"], dict(_TEXT_DYN), {"sequence": 64})


def _hf_t5() -> _TorchCase:
    """Full T5 encoder-decoder (T5ForConditionalGeneration), teacher-forced decoder ids."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=_VOCAB, d_model=_HIDDEN, d_kv=_HIDDEN // _HEADS, d_ff=_FFN,
                   num_layers=_LAYERS, num_decoder_layers=_LAYERS, num_heads=_HEADS,
                   relative_attention_num_buckets=8, relative_attention_max_distance=32,
                   use_cache=False, decoder_start_token_id=0, attn_implementation="eager",
                   pad_token_id=0, eos_token_id=1)
    feeds = _text_feeds("t5")
    rng = np.random.default_rng(_seed("t5/decoder"))
    feeds["decoder_input_ids"] = rng.integers(3, _VOCAB, size=(_BATCH, _DEC_SEQ), dtype=np.int64)
    model = _hf_wrapper(T5ForConditionalGeneration(cfg), list(feeds), lambda o: o.logits)
    dyn = {**_TEXT_DYN, "decoder_input_ids": {0: "batch", 1: "decoder_sequence"}}
    return _TorchCase(model, feeds, ["logits"], dyn, {"sequence": 64, "decoder_sequence": 64})


def _hf_vit() -> _TorchCase:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=_IMG, patch_size=8, hidden_size=_HIDDEN, num_hidden_layers=_LAYERS,
                    num_attention_heads=_HEADS, intermediate_size=_FFN, num_labels=10,
                    attn_implementation="eager")
    feeds = {"pixel_values": _image("vit")}
    model = _hf_wrapper(ViTForImageClassification(cfg), list(feeds), lambda o: o.logits)
    return _TorchCase(model, feeds, ["logits"], {"pixel_values": {0: "batch"}})


def _hf_whisper_encoder() -> _TorchCase:
    """WhisperEncoder alone: log-mel features [batch, mel bins, 2 * max_source_positions]."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = WhisperConfig(vocab_size=_VOCAB, num_mel_bins=16, d_model=_HIDDEN, encoder_layers=_LAYERS,
                        encoder_attention_heads=_HEADS, encoder_ffn_dim=_FFN, decoder_layers=1,
                        decoder_attention_heads=_HEADS, decoder_ffn_dim=_FFN, max_source_positions=32,
                        max_target_positions=32, attn_implementation="eager", pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    rng = np.random.default_rng(_seed("whisper/features"))
    feeds = {"input_features": rng.standard_normal((_BATCH, 16, 64), dtype=np.float32)}
    model = _hf_wrapper(WhisperEncoder(cfg), list(feeds), lambda o: o.last_hidden_state)
    return _TorchCase(model, feeds, ["last_hidden_state"], {"input_features": {0: "batch"}})


def _hf_clip() -> _TorchCase:
    """Full CLIPModel (text + vision towers); the eos token closes every valid text span."""
    from transformers import CLIPConfig, CLIPModel

    tower = dict(hidden_size=_HIDDEN, intermediate_size=_FFN, num_hidden_layers=_LAYERS,
                 num_attention_heads=_HEADS)
    cfg = CLIPConfig(text_config=dict(vocab_size=_VOCAB, max_position_embeddings=32, **tower, **_SPECIAL),
                     vision_config=dict(image_size=_IMG, patch_size=8, **tower),
                     projection_dim=32, attn_implementation="eager")
    feeds = _text_feeds("clip")
    lengths = feeds["attention_mask"].sum(axis=1)
    feeds["input_ids"][np.arange(_BATCH), lengths - 1] = _SPECIAL["eos_token_id"]
    feeds["pixel_values"] = _image("clip")
    model = _hf_wrapper(CLIPModel(cfg), list(feeds),
                          lambda o: (o.logits_per_image, o.text_embeds, o.image_embeds))
    dyn = {**_TEXT_DYN, "pixel_values": {0: "images"}}
    return _TorchCase(model, feeds, ["logits_per_image", "text_embeds", "image_embeds"], dyn,
                      {"sequence": 32})


_HF_ARCHS: dict[str, Callable[[], _TorchCase]] = {
    "bert": _hf_bert, "gpt2": _hf_gpt2, "vit": _hf_vit, "t5": _hf_t5, "llama": _hf_llama,
    "whisper-encoder": _hf_whisper_encoder, "clip": _hf_clip,
}
_EXPORTS = (("torchscript", 13), ("torchscript", 17), ("dynamo", 18))
_HF_FAST = {"hf/bert-torchscript-op13", "hf/gpt2-dynamo-op18", "hf/llama-torchscript-op17"}

for _arch, _make in _HF_ARCHS.items():
    for _exp, _op in _EXPORTS:
        _n = f"hf/{_arch}-{_exp}-op{_op}"
        _register(_n, lambda _n=_n, _m=_make, _e=_exp, _o=_op: _torch_model(_n, "hf", _m, _e, _o),
                  fast=_n in _HF_FAST)


# =========================================================================== #
# torchnn: small hand-written torch networks
# =========================================================================== #
def _nn_lstm() -> _TorchCase:
    """2-layer LSTM + linear head: exported as ONNX LSTM (TorchScript) or unrolled / Scan (dynamo)."""
    import torch

    class LSTMHead(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = torch.nn.LSTM(16, 32, num_layers=2, batch_first=True)
            self.head = torch.nn.Linear(32, 8)

        def forward(self, x):
            y, _ = self.lstm(x)
            return self.head(y)

    rng = np.random.default_rng(_seed("lstm"))
    feeds = {"x": rng.standard_normal((2, 10, 16), dtype=np.float32)}
    return _TorchCase(LSTMHead(), feeds, ["y"], {"x": {0: "batch", 1: "sequence"}})


def _nn_unet() -> _TorchCase:
    """Two-level UNet: GroupNorm + SiLU blocks, strided-conv down, ConvTranspose and
    nearest Resize up, concatenated skip connections."""
    import torch
    from torch import nn

    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU())

    class UNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc1, self.enc2 = block(3, 16), block(16, 32)
            self.down1 = nn.Conv2d(16, 16, 3, stride=2, padding=1)
            self.down2 = nn.Conv2d(32, 32, 3, stride=2, padding=1)
            self.mid = block(32, 32)
            self.up2 = nn.ConvTranspose2d(32, 32, 2, stride=2)
            self.dec2 = block(64, 16)
            self.dec1 = block(32, 16)
            self.out = nn.Conv2d(16, 3, 1)

        def forward(self, x):
            e1 = self.enc1(x)
            e2 = self.enc2(self.down1(e1))
            m = self.mid(self.down2(e2))
            d2 = self.dec2(torch.cat([self.up2(m), e2], dim=1))
            up1 = nn.functional.interpolate(d2, scale_factor=2.0, mode="nearest")
            return self.out(self.dec1(torch.cat([up1, e1], dim=1)))

    rng = np.random.default_rng(_seed("unet"))
    feeds = {"x": rng.standard_normal((1, 3, 32, 32), dtype=np.float32)}
    return _TorchCase(UNet(), feeds, ["y"], {"x": {0: "batch"}})


def _nn_resnet() -> _TorchCase:
    """Small ResNet (BasicBlocks, one strided with a projection shortcut) with
    BatchNorm; randomised running stats so eval-mode BN is not an identity."""
    import torch
    from torch import nn

    class Basic(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
            self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
            self.proj = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            y = torch.relu(self.b1(self.c1(x)))
            return torch.relu(self.b2(self.c2(y)) + self.proj(x))

    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
            self.layers = nn.Sequential(Basic(16, 16, 1), Basic(16, 32, 2))
            self.fc = nn.Linear(32, 10)

        def forward(self, x):
            y = self.layers(self.stem(x))
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))

    net = ResNet()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.8, 1.2)
                m.bias.uniform_(-0.1, 0.1)
    rng = np.random.default_rng(_seed("resnet-bn"))
    feeds = {"x": rng.standard_normal((2, 3, 32, 32), dtype=np.float32)}
    return _TorchCase(net, feeds, ["logits"], {"x": {0: "batch"}}, keep_batchnorm=True)


_TORCHNN = (
    ("torchnn/lstm-op13", _nn_lstm, "torchscript", 13, True),
    ("torchnn/lstm-dynamo-op18", _nn_lstm, "dynamo", 18, False),
    ("torchnn/unet-groupnorm-op17", _nn_unet, "torchscript", 17, True),
    ("torchnn/resnet-bn-op13", _nn_resnet, "torchscript", 13, True),
    ("torchnn/resnet-bn-op17", _nn_resnet, "torchscript", 17, False),
)
for _n, _make, _exp, _op, _fast in _TORCHNN:
    _register(_n, lambda _n=_n, _m=_make, _e=_exp, _o=_op: _torch_model(_n, "torchnn", _m, _e, _o),
              fast=_fast)


# =========================================================================== #
# control: If / Loop written in ONNX text
# =========================================================================== #
_CONTROL_HEADER = '<ir_version: 8, opset_import: ["" : 17]>'
_D = 8  # feature width of the control-flow models


def _if_node(out: str, cond: str, tag: str) -> str:
    """An If whose then-branch is MatMul + outer-scope Add + Softmax and whose
    else-branch is MatMul + Relu; both read ``h``/``shift`` from the outer graph."""
    return f"""
    {out} = If({cond}) <
        then_branch = then_{tag} () => (float[N, {_D}] t_out_{tag}) {{
            t1_{tag} = MatMul(h, w_then)
            t2_{tag} = Add(t1_{tag}, shift)
            t_out_{tag} = Softmax<axis = -1>(t2_{tag})
        }},
        else_branch = else_{tag} () => (float[N, {_D}] e_out_{tag}) {{
            e1_{tag} = MatMul(h, w_else)
            e_out_{tag} = Relu(e1_{tag})
        }}
    >"""


def _control_if() -> CorpusModel:
    """Two If nodes on ``cond`` and ``not cond`` so one run executes both branch kinds."""
    text = f"""{_CONTROL_HEADER}
    control_if (float[N, {_D}] x, bool cond) => (float[N, {_D}] y, float[N, {_D}] z) {{
        h = MatMul(x, w_in)
        shift = Mul(h, half)
        {_if_node("y", "cond", "a")}
        not_cond = Not(cond)
        {_if_node("z", "not_cond", "b")}
    }}"""
    rng = np.random.default_rng(_seed("control/if"))
    std = np.sqrt(1.0 / _D)
    weights = {"w_in": _normal(rng, (_D, _D), std), "w_then": _normal(rng, (_D, _D), std),
               "w_else": _normal(rng, (_D, _D), std), "half": np.array(0.5, np.float32)}
    feeds = {"x": rng.standard_normal((4, _D), dtype=np.float32), "cond": np.array(True)}
    return CorpusModel(name="control/if", model=_parse_with_weights(text, weights), feeds=feeds,
                       family="control", logits=["y", "z"], exporter="onnx-parser", opset=17)


def _control_loop() -> CorpusModel:
    """A Loop with an FP32 carried state, a scan output (ReduceSum in the body),
    outer-scope float values (computed ``bias`` and initializer ``w_loop``) and a
    nested If (Tanh on even iterations, Softmax on odd ones)."""
    text = f"""{_CONTROL_HEADER}
    control_loop (float[N, {_D}] x) => (float[N, {_D}] state, float[T, N] sums) {{
        bias = Mul(x, alpha)
        state, sums = Loop(trip_count, keep_going, x) <
            body = loop_body (int64 i, bool c_in, float[N, {_D}] s_in)
                          => (bool c_out, float[N, {_D}] s_out, float[N] r) {{
                m = MatMul(s_in, w_loop)
                a = Add(m, bias)
                r = ReduceSum<keepdims = 0>(a, last_axis)
                parity = Mod(i, two)
                even = Equal(parity, zero)
                s_out = If(even) <
                    then_branch = even_g () => (float[N, {_D}] ev) {{ ev = Tanh(a) }},
                    else_branch = odd_g () => (float[N, {_D}] od) {{
                        sm = Softmax<axis = -1>(a)
                        od = Mul(sm, width)
                    }}
                >
                c_out = Identity(c_in)
            }}
        >
    }}"""
    rng = np.random.default_rng(_seed("control/loop"))
    weights = {"w_loop": _normal(rng, (_D, _D), np.sqrt(1.0 / _D)), "alpha": np.array(0.5, np.float32),
               "width": np.array(float(_D), np.float32), "last_axis": np.array([-1], np.int64),
               "trip_count": np.array(4, np.int64), "keep_going": np.array(True),
               "two": np.array(2, np.int64), "zero": np.array(0, np.int64)}
    feeds = {"x": rng.standard_normal((4, _D), dtype=np.float32)}
    return CorpusModel(name="control/loop", model=_parse_with_weights(text, weights), feeds=feeds,
                       family="control", logits=["state", "sums"], exporter="onnx-parser", opset=17)


_register("control/if", _control_if, fast=True)
_register("control/loop", _control_loop, fast=True)


# =========================================================================== #
# synthetic: hand-written transformer block and CNN
# =========================================================================== #
_TB_D, _TB_H, _TB_S, _TB_F = 32, 4, 16, 128


def _layernorm_text(x: str, gamma: str, beta: str, out: str, opset: int) -> str:
    """LayerNorm as one op (opset >= 17) or decomposed exactly as the TorchScript
    exporter writes it at opset 13 -- the pattern AMP must keep in FP32."""
    if opset >= 17:
        return f"{out} = LayerNormalization<axis = -1, epsilon = 1e-5>({x}, {gamma}, {beta})"
    p = out + "_"
    return f"""
        {p}mean = ReduceMean<axes = [-1]>({x})
        {p}d = Sub({x}, {p}mean)
        {p}sq = Pow({p}d, two)
        {p}var = ReduceMean<axes = [-1]>({p}sq)
        {p}ve = Add({p}var, eps)
        {p}std = Sqrt({p}ve)
        {p}n = Div({p}d, {p}std)
        {p}g = Mul({p}n, {gamma})
        {out} = Add({p}g, {beta})"""


def _transformer_block(opset: int) -> CorpusModel:
    """Pre-LN block: fused QKV MatMul + Split, scaled-dot-product attention with an
    additive causal mask of -1e9 (overflows FP16), Erf-GELU MLP, residual Adds."""
    d, h, s, f = _TB_D, _TB_H, _TB_S, _TB_F
    text = f"""<ir_version: 8, opset_import: ["" : {opset}]>
    transformer_block (float[batch, {s}, {d}] x) => (float[batch, {s}, {d}] y) {{
        {_layernorm_text("x", "ln1_gamma", "ln1_beta", "ln1", opset)}
        qkv_mm = MatMul(ln1, w_qkv)
        qkv = Add(qkv_mm, b_qkv)
        q, k, v = Split<axis = -1>(qkv, qkv_split)
        q4 = Reshape(q, heads_shape)
        k4 = Reshape(k, heads_shape)
        v4 = Reshape(v, heads_shape)
        qh = Transpose<perm = [0, 2, 1, 3]>(q4)
        kt = Transpose<perm = [0, 2, 3, 1]>(k4)
        vh = Transpose<perm = [0, 2, 1, 3]>(v4)
        scores = MatMul(qh, kt)
        scaled = Mul(scores, inv_sqrt_dh)
        masked = Add(scaled, causal_mask)
        probs = Softmax<axis = -1>(masked)
        ctx = MatMul(probs, vh)
        ctx_t = Transpose<perm = [0, 2, 1, 3]>(ctx)
        ctx_m = Reshape(ctx_t, model_shape)
        o_mm = MatMul(ctx_m, w_o)
        o = Add(o_mm, b_o)
        x1 = Add(x, o)
        {_layernorm_text("x1", "ln2_gamma", "ln2_beta", "ln2", opset)}
        h_mm = MatMul(ln2, w_1)
        hh = Add(h_mm, b_1)
        hs = Div(hh, sqrt2)
        he = Erf(hs)
        he1 = Add(he, one)
        hg = Mul(hh, he1)
        gelu = Mul(hg, half)
        f_mm = MatMul(gelu, w_2)
        ff = Add(f_mm, b_2)
        y = Add(x1, ff)
    }}"""
    rng = np.random.default_rng(_seed("synthetic/transformer-block"))
    causal = np.triu(np.full((s, s), -1e9, np.float32), k=1).reshape(1, 1, s, s)
    weights = {
        "ln1_gamma": 1 + _normal(rng, (d,), 0.1), "ln1_beta": _normal(rng, (d,), 0.1),
        "ln2_gamma": 1 + _normal(rng, (d,), 0.1), "ln2_beta": _normal(rng, (d,), 0.1),
        "w_qkv": _normal(rng, (d, 3 * d), d ** -0.5), "b_qkv": _normal(rng, (3 * d,), 0.02),
        "w_o": _normal(rng, (d, d), d ** -0.5), "b_o": _normal(rng, (d,), 0.02),
        "w_1": _normal(rng, (d, f), d ** -0.5), "b_1": _normal(rng, (f,), 0.02),
        "w_2": _normal(rng, (f, d), f ** -0.5), "b_2": _normal(rng, (d,), 0.02),
        "qkv_split": np.array([d, d, d], np.int64),
        "heads_shape": np.array([0, 0, h, d // h], np.int64), "model_shape": np.array([0, 0, d], np.int64),
        "inv_sqrt_dh": np.array((d // h) ** -0.5, np.float32), "causal_mask": causal,
        "sqrt2": np.array(np.sqrt(2.0), np.float32), "one": np.array(1.0, np.float32),
        "half": np.array(0.5, np.float32),
    }
    if opset < 17:
        weights.update(two=np.array(2.0, np.float32), eps=np.array(1e-5, np.float32))
    feeds = {"x": rng.standard_normal((2, s, d), dtype=np.float32)}
    return CorpusModel(name=f"synthetic/transformer-block-op{opset}", model=_parse_with_weights(text, weights),
                       feeds=feeds, family="synthetic", logits=["y"], exporter="onnx-parser", opset=opset)


def _cnn_bn() -> CorpusModel:
    """Conv + BatchNorm + Relu + MaxPool twice, GlobalAveragePool, Flatten, Gemm (opset 17).

    Written by hand so the BatchNormalization nodes survive (exporters fold
    them into the convolutions)."""
    text = """<ir_version: 8, opset_import: ["" : 17]>
    cnn_bn (float[batch, 3, 32, 32] x) => (float[batch, 10] logits) {
        c1 = Conv<kernel_shape = [3, 3], pads = [1, 1, 1, 1]>(x, w1, b1)
        n1 = BatchNormalization<epsilon = 1e-5>(c1, g1, be1, m1, v1)
        r1 = Relu(n1)
        p1 = MaxPool<kernel_shape = [2, 2], strides = [2, 2]>(r1)
        c2 = Conv<kernel_shape = [3, 3], pads = [1, 1, 1, 1]>(p1, w2, b2)
        n2 = BatchNormalization<epsilon = 1e-5>(c2, g2, be2, m2, v2)
        r2 = Relu(n2)
        p2 = MaxPool<kernel_shape = [2, 2], strides = [2, 2]>(r2)
        gap = GlobalAveragePool(p2)
        flat = Flatten<axis = 1>(gap)
        logits = Gemm<transB = 1>(flat, wf, bf)
    }"""
    rng = np.random.default_rng(_seed("synthetic/cnn-bn"))

    def bn(c: int, prefix: str, mean_scale: float) -> dict[str, np.ndarray]:
        return {f"g{prefix}": rng.uniform(0.8, 1.2, c).astype(np.float32),
                f"be{prefix}": _normal(rng, (c,), 0.1),
                f"m{prefix}": _normal(rng, (c,), mean_scale),
                f"v{prefix}": rng.uniform(0.5, 1.5, c).astype(np.float32)}

    weights = {"w1": _he(rng, 27, 8, 3, 3, 3), "b1": _normal(rng, (8,), 0.05), **bn(8, "1", 0.1),
               "w2": _he(rng, 72, 16, 8, 3, 3), "b2": _normal(rng, (16,), 0.05), **bn(16, "2", 0.1),
               "wf": _he(rng, 16, 10, 16), "bf": _normal(rng, (10,), 0.05)}
    feeds = {"x": rng.standard_normal((2, 3, 32, 32), dtype=np.float32)}
    return CorpusModel(name="synthetic/cnn-bn-op17", model=_parse_with_weights(text, weights), feeds=feeds,
                       family="synthetic", logits=["logits"], exporter="onnx-parser", opset=17)


_register("synthetic/transformer-block-op13", lambda: _transformer_block(13), fast=True)
_register("synthetic/transformer-block-op17", lambda: _transformer_block(17), fast=True)
_register("synthetic/cnn-bn-op17", _cnn_bn, fast=True)
