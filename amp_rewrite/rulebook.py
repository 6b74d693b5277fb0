"""Rule files: which ops compute in low precision, which stay FP32, and why.

A rule set sorts op types into the four categories of the precision contract (allow, infer, clear,
deny; see shared/design/PRECISION.md) and names nodes that must stay FP32 or become low precision.
Rule sets are TOML files (schema: rules/README.md). The built-in ones live in ``rules/`` and are
installed as the ``amp_rewrite.rules`` package; a user file layers on top of the built-in default
for its (frontend, target) unless it asks to stand alone.

Why validation is strict: a rule file is configuration that silently changes numerics. A typo in
an op name would otherwise leave the op unlisted (treated as deny) and nobody would notice, so
every mistake is an error that names the file, the key and the closest valid spelling.

Stdlib only (tomllib, difflib): this module must not import onnx, onnxruntime or torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import fnmatch
import functools
import re
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from types import MappingProxyType
from typing import Any, Collection, Iterable, Mapping, Sequence

from amp_rewrite import kernels
from amp_rewrite.decisions import Category, Precision
from amp_rewrite.errors import RuleFileError, UsageError

LISTS: Mapping[str, Category] = MappingProxyType(
    {
        "allow": Category.ALLOW,
        "infer": Category.INFER,
        "clear": Category.CLEAR,
        "deny": Category.DENY,
    }
)
TOP_LEVEL_KEYS = ("ruleset", *LISTS, "nodes")
RULESET_KEYS = ("name", "frontend", "target", "provider", "description", "extends", "replace")
ENTRY_KEYS = ("reason", "since", "until", "fp32_inputs", "accumulates_fp32", "bounded_output", "fp32_argument")
NODE_KEYS = ("fp32", "low")
FRONTENDS = ("onnx", "torch")
TARGETS = ("fp16", "bf16")

_DEFAULT_RULESETS: Mapping[tuple[str, str], str] = MappingProxyType(
    {
        ("onnx", "fp16"): "onnx-cuda-fp16",
        ("onnx", "bf16"): "onnx-cuda-bf16",
        ("torch", "fp16"): "torch-fp16",
        ("torch", "bf16"): "torch-bf16",
    }
)

# Standard ai.onnx ops that onnxruntime implements by expanding their function body (or, for
# Constant, by folding into an initializer), so the kernel table has no row for them. They are
# still real op names a model can contain. Taken from the onnx 1.23 schemas.
_ONNX_OPS_WITHOUT_KERNEL_ROWS = frozenset(
    {
        "Bernoulli",
        "CastLike",
        "CausalConvWithState",
        "CenterCropPad",
        "Constant",
        "GroupNormalization",
        "ImageDecoder",
        "LinearAttention",
        "Mish",
        "NegativeLogLikelihoodLoss",
        "SequenceMap",
        "SoftmaxCrossEntropyLoss",
        "SwiGLU",
        "Swish",
    }
)

_UNKNOWN_OP = {
    "onnx": "unknown ONNX op",
    "torch": 'unknown torch op (the built-in torch sets do not name it; write custom ops as "lib:op")',
}
_GLOB_CHARS = frozenset("*?[")
_REGEX_PREFIX = "re:"
_CLI_FP32_OPS = "--fp32-ops"
_CLI_LOW_OPS = "--fp16-ops"
_CLI_FP32_NODES = "--fp32-nodes"
_CLI_LOW_NODES = "--fp16-nodes"


# --------------------------------------------------------------------------------------------
# Public records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuleEntry:
    """One op's category over an inclusive opset range, with the reason a report shows."""

    op: str
    domain: str
    category: Category
    reason: str
    source: str
    since: int | None = None
    until: int | None = None
    fp32_inputs: tuple[int | str, ...] = ()
    accumulates_fp32: bool = False
    # deny ops only: the op must compute in FP32, but its output is bounded (Sin, Cos: [-1, 1]), so
    # deny paint does not spread from it; its readers are decided as if it were any other input.
    bounded_output: bool = False
    # deny ops only: the op needs a precise argument (Sin, Cos: fp16 spacing is 1.0 at 1024), so
    # where that argument is computed from integers and constants only (positions), the nodes
    # computing it keep FP32 too, whatever their own rule (a rotary MatMul included).
    fp32_argument: bool = False

    def covers(self, opset: int) -> bool:
        """Whether the entry applies at ``opset`` (open ends cover everything on that side)."""
        if self.since is not None and opset < self.since:
            return False
        return self.until is None or opset <= self.until

    def overlaps(self, other: RuleEntry) -> bool:
        low = max(self.since or 0, other.since or 0)
        high = min(_upper(self.until), _upper(other.until))
        return low <= high


@dataclass(frozen=True)
class NodeRule:
    """A node-name pattern forcing a precision: exact name, glob, or ``re:<regex>``."""

    pattern: str
    precision: Precision
    source: str

    def matches(self, name: str, names: Collection[str] = ()) -> bool:
        """Whether the pattern names ``name``. ``names``: every node name (and label) of the model.
        A pattern that is one of them is that node's name, not a glob: 'layer[0]/mm' pins the node
        of that name and not also ``layer0/mm``."""
        if name == self.pattern:  # the exact name first: 'layer[0]/mm' is a name before it is a glob
            return True
        if self.pattern in names:
            return False
        if self.pattern.startswith(_REGEX_PREFIX):
            return _compiled(self.pattern[len(_REGEX_PREFIX) :]).fullmatch(name) is not None
        if _GLOB_CHARS.intersection(self.pattern):
            if fnmatch.fnmatchcase(name, self.pattern):
                return True
            # a torch node is named <dotted module path>/<fx name> (b1.fc/linear): a glob of a path
            # with slashes, as ONNX names are written ('b1/*'), names its submodules' nodes too (an
            # ONNX name has slashes in its path, '/enc/layer.0/fc/MatMul': its dots stay dots)
            path, slash, leaf = name.rpartition("/")
            return bool(slash) and "." in path and "/" not in path and "/" in self.pattern and \
                fnmatch.fnmatchcase(f"{path.replace('.', '/')}/{leaf}", self.pattern)
        return name == self.pattern


@dataclass(frozen=True, eq=False)
class RuleBook:
    """The composed rule set a pipeline runs with. Immutable: build a new one to change it."""

    name: str
    frontend: str
    target: str
    provider: str | None
    files: tuple[str, ...]
    _table: Mapping[tuple[str, str], tuple[RuleEntry, ...]] = field(repr=False)
    _node_rules: tuple[NodeRule, ...] = field(repr=False)  # highest layer first

    def lookup(self, op: str, domain: str = "", opset: int | None = None) -> RuleEntry | None:
        """The entry for ``op`` whose opset range covers ``opset``.

        Without an opset, the open-ended (newest) entry is preferred: it describes the op as
        current models use it.
        """
        candidates = self._table.get((_canonical_domain(domain), op), ())
        if opset is None:
            return max(candidates, key=_newest_first_key, default=None)
        return next((entry for entry in candidates if entry.covers(opset)), None)

    def category_of(self, op: str, domain: str = "", opset: int | None = None) -> Category:
        entry = self.lookup(op, domain, opset)
        return Category.UNLISTED if entry is None else entry.category

    def node_rule(self, name: str | Sequence[str], names: Collection[str] = ()) -> NodeRule | None:
        """The rule forcing the node called ``name`` (or any of several names for one node: its name
        and its scope label); FP32 rules win because keeping FP32 is the safe side. ``names``: all
        node names of the model (see :meth:`NodeRule.matches`)."""
        aliases = (name,) if isinstance(name, str) else tuple(name)
        matching = [rule for rule in self._node_rules if any(rule.matches(a, names) for a in aliases)]
        for rule in matching:
            if rule.precision is Precision.FP32:
                return rule
        return matching[0] if matching else None

    def entries(self) -> list[RuleEntry]:
        ordered = sorted(self._table.items(), key=lambda item: item[0])
        return [entry for _, group in ordered for entry in group]

    def node_rules(self) -> list[NodeRule]:
        return list(self._node_rules)

    def with_overrides(self, *, fp32_ops: Iterable[str] = (), low_ops: Iterable[str] = (),
                       fp32_nodes: Iterable[str] = (), low_nodes: Iterable[str] = ()) -> "RuleBook":
        """This book with command-line style overrides on top (``load_rules`` puts its ``fp32_ops``
        ... arguments over its files so): an op named moves to deny/allow, a node pattern pins nodes."""
        cli = _cli_layer(self.frontend, list(fp32_ops), list(low_ops), list(fp32_nodes), list(low_nodes))
        if cli is None:
            return self
        return dataclasses.replace(self, _table=MappingProxyType({**self._table, **cli.entries}),
                                   _node_rules=tuple(cli.nodes) + self._node_rules)

    def file_and_key(self, entry: RuleEntry) -> tuple[str, str]:
        """The file ``entry`` came from, as the user gave it where that is unambiguous (entries name
        it by its base name), and the entry's key in it: for errors that point into the file."""
        shown, _, key = entry.source.rpartition(": ")  # (a file's name may hold ": ", a key not)
        paths = [path for path in self.files if Path(path).name == shown]
        return (paths[0] if len(paths) == 1 else shown), key


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def builtin_names() -> list[str]:
    """Names of the rule sets shipped with the package (the ``*.toml`` files in ``rules/``)."""
    return sorted(item.name[: -len(".toml")] for item in _builtin_dir().iterdir() if _is_toml(item))


def default_ruleset(frontend: str, target: str) -> str:
    """The built-in rule set a (frontend, target) pair starts from."""
    _check_choice("frontend", frontend, FRONTENDS)
    _check_choice("target", target, TARGETS)
    return _DEFAULT_RULESETS[(frontend, target)]


def load_rules(
    files: Iterable[str | os.PathLike] = (),
    *,
    frontend: str = "onnx",
    target: str = "fp16",
    fp32_ops: Iterable[str] = (),
    low_ops: Iterable[str] = (),
    fp32_nodes: Iterable[str] = (),
    low_nodes: Iterable[str] = (),
) -> RuleBook:
    """Compose the built-in default for (frontend, target), the user files, and CLI overrides.

    Files apply in order, each with its own ``extends`` chain underneath it; a file (or a file in
    its chain) with ``replace = true`` discards everything below it. Command-line op overrides
    are the top layer, so they win over every file.
    """
    if isinstance(files, (str, os.PathLike)):  # one path, not an iterable of characters
        files = [files]
    stack = [_builtin_layer(default_ruleset(frontend, target))]
    for file in files:
        chain = _file_chain(Path(file), frontend, target, seen=())
        if any(layer.replace for layer in chain):
            stack = chain
            continue
        # An extends chain adds only the sets not in the stack yet; the file itself applies where
        # it is listed, though an earlier file's chain brought it in already (files apply in order)
        *below, own = chain
        present = {layer.identity for layer in stack}
        stack = [layer for layer in stack if layer.identity != own.identity]
        stack.extend(layer for layer in below if layer.identity not in present)
        stack.append(own)
    return _compose(_distinct_sources(stack), frontend, target).with_overrides(
        fp32_ops=fp32_ops, low_ops=low_ops, fp32_nodes=fp32_nodes, low_nodes=low_nodes)


def _distinct_sources(stack: list[_Layer]) -> list[_Layer]:
    """Entries name their file by its base name; files of one base name in different folders
    (``a/rules.toml``, ``b/rules.toml``) are named by their paths instead, so that a decision's
    reason and an error tell them apart."""
    seen = Counter(Path(layer.path).name for layer in stack if layer.path)
    # (a built-in set keeps its name: re-sourced by its path, its decisions passed for a user's file
    # beside a user's copy of it, and the copy's pins, named by the bare file name, for built-in
    # rules, which a rewrite of the output decides afresh)
    return [_sourced_by_path(layer) if layer.path and seen[Path(layer.path).name] > 1
            and not layer.identity.startswith("builtin:") else layer for layer in stack]


def _sourced_by_path(layer: _Layer) -> _Layer:
    path = layer.path
    if Path(path).parent == Path(".") and Path(path).suffix == ".toml" and Path(path).stem in builtin_names():
        path = f"./{path}"  # (a user's copy of a built-in set, given by its bare name: not the built-in's name)

    def by_path(item: Any) -> Any:
        return dataclasses.replace(item, source=f"{path}: {_entry_key(item)}")

    entries = {key: tuple(map(by_path, group)) for key, group in layer.entries.items()}
    nodes = tuple(map(by_path, layer.nodes))
    return dataclasses.replace(layer, entries=MappingProxyType(entries), nodes=nodes)


# --------------------------------------------------------------------------------------------
# Layers: one parsed file each
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layer:
    name: str
    identity: str  # resolved path or "builtin:<name>": the same file is never layered twice
    path: str | None
    frontend: str | None
    target: str | None
    provider: str | None
    extends: str | None
    replace: bool
    entries: Mapping[tuple[str, str], tuple[RuleEntry, ...]]
    nodes: tuple[NodeRule, ...]

    def op_names(self) -> set[str]:
        """The default-domain op names the layer's entries use (a ``domain:Op`` entry's name is that
        domain's: it must not make a bare spelling of the name valid)."""
        return {op for (domain, op) in self.entries if not domain}


def _compose(stack: list[_Layer], frontend: str, target: str) -> RuleBook:
    """Upper layers replace every entry of an op from lower layers, whatever list it was in."""
    table: dict[tuple[str, str], tuple[RuleEntry, ...]] = {}
    for layer in stack:
        table.update(layer.entries)
    node_rules = tuple(rule for layer in reversed(stack) for rule in layer.nodes)
    provider = next((layer.provider for layer in reversed(stack) if layer.provider), None)
    return RuleBook(
        name="+".join(layer.name for layer in stack),
        frontend=frontend,
        target=target,
        provider=provider if frontend == "onnx" else None,
        files=tuple(layer.path for layer in stack if layer.path),
        _table=MappingProxyType(table),
        _node_rules=node_rules,
    )


def _file_chain(path: Path, frontend: str, target: str, seen: tuple[str, ...]) -> list[_Layer]:
    """The layers a user file brings: its ``extends`` chain (lowest first), then the file."""
    shown = str(path)
    identity = str(path.resolve())
    if identity in seen:
        chain = " -> ".join(Path(p).name for p in (*seen[seen.index(identity):], identity))
        problem = ("this file extends itself" if seen[-1] == identity else
                   f"this file is reached again through its own extends chain ({chain})")
        raise RuleFileError(shown, "ruleset.extends", f"extends cycle: {problem}")
    # Decisions name their file by its base name, which must not pass for a built-in set's (a copy
    # of onnx-cuda-fp16.toml edited by the user): a rewrite of the output would take the user's
    # pins for built-in rules and decide them afresh. Such a file is named by its path.
    source = path.name
    if path.suffix == ".toml" and path.stem in builtin_names():
        source = shown if path.parent != Path(".") else f"./{shown}"
    layer = _parse_layer(_read_toml(path), shown, path.stem, identity, shown, source)
    _check_matches_request(layer, frontend, target)
    below = _extended_layers(layer, path, frontend, target, seen + (identity,))
    known_extra = set().union(*(lower.op_names() for lower in below))
    _check_op_names(layer, frontend, known_extra)
    return below + [layer]


def _extended_layers(
    layer: _Layer, path: Path, frontend: str, target: str, seen: tuple[str, ...]
) -> list[_Layer]:
    if layer.extends is None:
        return []
    if layer.extends in builtin_names():
        base = _builtin_layer(layer.extends)
        _check_matches_request(base, frontend, target, via=f"{layer.path}: ruleset.extends")
        return [base]
    target_path = path.parent / layer.extends
    if not target_path.is_file():
        raise RuleFileError(
            str(layer.path),
            "ruleset.extends",
            f"no built-in rule set or file named {layer.extends!r} (looked for {target_path})",
            _closest(layer.extends, builtin_names()),
        )
    try:
        return _file_chain(target_path, frontend, target, seen)
    except RuleFileError as exc:
        # the user named the file at the top of the chain: say how the failing one was reached
        if exc.path != str(layer.path) and "(reached through " not in str(exc):
            exc.args = (f"{exc.args[0]} (reached through {layer.path}: ruleset.extends)",)
        raise


def _check_matches_request(layer: _Layer, frontend: str, target: str, via: str = "") -> None:
    """A file written for bf16 silently applied to an fp16 rewrite would mislead: refuse it."""
    where = layer.path or layer.name
    for key, wanted, have in (("frontend", frontend, layer.frontend), ("target", target, layer.target)):
        if have is not None and have != wanted:
            context = f" (reached through {via})" if via else ""
            raise RuleFileError(
                str(where),
                f"ruleset.{key}",
                f"this rule set is for {key} {have!r} but the rewrite asks for {wanted!r}{context}",
            )
    if layer.provider is not None and frontend != "onnx":
        # (a file that names no frontend is checked here, against the rewrite's: its provider
        # would otherwise be dropped without a word)
        context = f" (reached through {via})" if via else ""
        raise RuleFileError(str(where), "ruleset.provider",
                            f"only ONNX rule sets name an execution provider; this is a {frontend} rewrite{context}")


@functools.lru_cache(maxsize=None)
def _builtin_layer(name: str) -> _Layer:
    """A shipped rule set, parsed and validated once per process."""
    if name not in builtin_names():
        raise UsageError(f"no built-in rule set {name!r} (have: {', '.join(builtin_names())})")
    item = _builtin_dir().joinpath(f"{name}.toml")
    shown = str(item)
    data = _parse_text(item.read_text("utf-8"), shown)
    layer = _parse_layer(data, shown, name, f"builtin:{name}", shown)
    _check_builtin_header(layer, name, shown)
    if layer.frontend == "onnx":  # the torch built-ins *are* the torch vocabulary
        _check_op_names(layer, "onnx", set())
    return layer


def _check_builtin_header(layer: _Layer, name: str, shown: str) -> None:
    """Built-ins are the reference a user file extends: their header must be complete."""
    if layer.name != name:
        raise RuleFileError(shown, "ruleset.name", f"must be {name!r}, the file's base name")
    if layer.frontend is None or layer.target is None:
        raise RuleFileError(shown, "ruleset", "built-in rule sets must set frontend and target")
    if layer.extends is not None or layer.replace:
        raise RuleFileError(shown, "ruleset", "built-in rule sets stand alone: no extends or replace")


def _builtin_dir() -> Traversable:
    """The shipped rule files: the ``amp_rewrite.rules`` package once installed, else the
    ``rules/`` folder of a source checkout (pyproject maps that folder onto the package)."""
    try:
        return resources.files("amp_rewrite.rules")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "rules"


def _is_toml(item: Traversable) -> bool:
    return item.is_file() and item.name.endswith(".toml")


# --------------------------------------------------------------------------------------------
# Reading and parsing one file
# --------------------------------------------------------------------------------------------


def _read_toml(path: Path) -> dict[str, Any]:
    shown = str(path)
    try:
        path.stat()
    except FileNotFoundError:
        pass
    except OSError as exc:  # (a name too long, a loop of links: is_file() raises those on Python 3.11)
        raise RuleFileError(shown, "(file)", f"cannot be opened ({exc.strerror or exc})") from None
    if not path.is_file():
        problem = ("is a directory, not a rule file" if path.is_dir() else
                   "is not a regular file" if path.exists() else "file not found")
        raise RuleFileError(shown, "(file)", problem)
    try:
        text = path.read_text(encoding="utf-8-sig")  # (a byte-order mark, as some editors write, is no TOML)
    except (OSError, UnicodeDecodeError) as exc:
        raise RuleFileError(shown, "(file)", f"cannot read it: {exc}") from exc
    return _parse_text(text, shown)


def _parse_text(text: str, shown: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = re.search(r"at line (\d+)", str(exc))
        key = f"line {line.group(1)}" if line else "(syntax)"
        raise RuleFileError(shown, key, f"TOML syntax error: {exc}") from exc
    except RecursionError:  # (tomllib parses nested arrays and tables recursively)
        raise RuleFileError(shown, "(syntax)", "values nested too deeply to parse; a rule file needs at "
                                               "most an array of tables") from None


def _parse_layer(data: dict[str, Any], shown: str, stem: str, identity: str, path: str,
                 source: str | None = None) -> _Layer:
    """Structure and value types of one file; op names are checked later, against its chain.
    ``source``: how its entries name the file (its base name by default)."""
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            if key in RULESET_KEYS:  # (written above any table header: it belongs to [ruleset])
                raise RuleFileError(shown, key, f"unknown table; {key!r} is a key of [ruleset]: write it "
                                                f"under a [ruleset] header")
            raise RuleFileError(shown, key, "unknown table", _closest(key, TOP_LEVEL_KEYS))
    header = _parse_ruleset(_table_at(data, "ruleset", shown), shown)
    base_name = source or Path(shown).name
    entries: list[RuleEntry] = []
    for list_name, category in LISTS.items():
        table = _table_at(data, list_name, shown)
        entries += _parse_list(list_name, category, table, shown, base_name)
    grouped = _group_checked(entries, shown)
    nodes = _parse_nodes(_table_at(data, "nodes", shown), shown, base_name)
    return _Layer(
        name=header.get("name", stem),
        identity=identity,
        path=path,
        frontend=header.get("frontend"),
        target=header.get("target"),
        provider=header.get("provider"),
        extends=header.get("extends"),
        replace=header.get("replace", False),
        entries=MappingProxyType(grouped),
        nodes=nodes,
    )


def _table_at(data: dict[str, Any], key: str, shown: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise RuleFileError(shown, key, f"must be a table ([{key}]), got {_type_name(value)}")
    return value


def _parse_ruleset(table: dict[str, Any], shown: str) -> dict[str, Any]:
    for key in table:
        if key not in RULESET_KEYS:
            raise RuleFileError(shown, f"ruleset.{key}", "unknown key", _closest(key, RULESET_KEYS))
    header: dict[str, Any] = {}
    for key in ("name", "provider", "description", "extends"):
        if key in table:
            header[key] = _non_empty_str(table[key], shown, f"ruleset.{key}")
    for key, choices in (("frontend", FRONTENDS), ("target", TARGETS)):
        if key in table:
            value = _non_empty_str(table[key], shown, f"ruleset.{key}")
            if value not in choices:
                problem = f"must be one of {', '.join(choices)}, got {value!r}"
                raise RuleFileError(shown, f"ruleset.{key}", problem, _closest(value, choices))
            header[key] = value
    if "replace" in table:
        header["replace"] = _bool(table["replace"], shown, "ruleset.replace")
    if "provider" in header:
        _check_provider(header["provider"], header.get("frontend"), shown)
    return header


def _check_provider(provider: str, frontend: str | None, shown: str) -> None:
    """The provider selects the kernel table the painter checks against: it must have one."""
    if frontend == "torch":
        raise RuleFileError(shown, "ruleset.provider", "only ONNX rule sets name an execution provider")
    known = kernels.providers()
    if provider not in known:
        problem = (
            f"no kernel table for {provider!r} (have: {', '.join(known)}); "
            "leave provider out to skip the kernel checks"
        )
        raise RuleFileError(shown, "ruleset.provider", problem, _closest(provider, known))


def _parse_list(
    list_name: str, category: Category, table: dict[str, Any], shown: str, base_name: str
) -> list[RuleEntry]:
    entries: list[RuleEntry] = []
    for op_key, value in table.items():
        key = f"{list_name}.{op_key}"
        domain, op = _split_op_key(op_key, shown, key)
        for index, spec in enumerate(_entry_specs(value, shown, key)):
            spec_key = key if not isinstance(value, list) else f"{key}[{index}]"
            source = f"{base_name}: {spec_key}"
            entries.append(_parse_entry(spec, op, domain, category, source, shown, spec_key))
    return entries


def _dotted_op(op: str, name: str, value: Any) -> str | None:
    """``"com.microsoft:Attention"`` for the tables TOML makes of an unquoted ``com.microsoft.Attention =
    "reason"`` (op ``com``, key ``microsoft``, value ``{"Attention": "reason"}``), else None."""
    parts = [op, name]
    while isinstance(value, dict) and len(value) == 1 and next(iter(value)) not in ENTRY_KEYS:
        (part, value), = value.items()
        parts.append(part)
    if not isinstance(value, (str, dict, list)) or len(parts) < 3:
        return None
    return f'"{".".join(parts[:-1])}:{parts[-1]}"'


def _entry_specs(value: Any, shown: str, key: str) -> list[dict[str, Any]]:
    """Normalise the three spellings: ``Op = "reason"``, ``[list.Op]``, ``[[list.Op]]``."""
    if isinstance(value, str):
        return [{"reason": value}]
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return value
    problem = f"expected a reason string or a table, got {_type_name(value)}"
    raise RuleFileError(shown, key, problem)


def _parse_entry(
    spec: dict[str, Any], op: str, domain: str, category: Category, source: str, shown: str, key: str
) -> RuleEntry:
    for name in spec:
        if name not in ENTRY_KEYS:
            dotted = _dotted_op(op, name, spec[name])
            if dotted is not None:  # ([deny] com.microsoft.Attention = "...": TOML made tables of the dots)
                raise RuleFileError(shown, f"{key}.{name}", f"unknown key; an op of a custom domain is one quoted name, "
                                                           f"the domain and a colon before the op: {dotted}")
            raise RuleFileError(shown, f"{key}.{name}", "unknown key", _closest(name, ENTRY_KEYS))
    if "reason" not in spec:
        raise RuleFileError(shown, f"{key}.reason", "missing: every entry needs a reason")
    reason = _non_empty_str(spec["reason"], shown, f"{key}.reason")
    since = _opset(spec.get("since"), shown, f"{key}.since")
    until = _opset(spec.get("until"), shown, f"{key}.until")
    if since is not None and until is not None and since > until:
        raise RuleFileError(shown, key, f"since ({since}) is greater than until ({until})")
    bounded = _bool(spec.get("bounded_output", False), shown, f"{key}.bounded_output")
    if bounded and category != Category.DENY:
        raise RuleFileError(shown, f"{key}.bounded_output",
                            f"only a deny entry can have a bounded output (this one is {category.value})")
    argument = _bool(spec.get("fp32_argument", False), shown, f"{key}.fp32_argument")
    if argument and category != Category.DENY:
        raise RuleFileError(shown, f"{key}.fp32_argument",
                            f"only a deny entry can keep its argument FP32 (this one is {category.value})")
    return RuleEntry(
        op=op,
        domain=domain,
        category=category,
        reason=reason,
        source=source,
        since=since,
        until=until,
        fp32_inputs=_fp32_inputs(spec.get("fp32_inputs", []), shown, f"{key}.fp32_inputs"),
        accumulates_fp32=_bool(spec.get("accumulates_fp32", False), shown, f"{key}.accumulates_fp32"),
        bounded_output=bounded,
        fp32_argument=argument,
    )


def _split_op_name(name: str) -> tuple[str, str] | None:
    """``"com.microsoft:Attention"`` -> (domain, op); a bare name, or one with an empty domain
    (``":Softmax"``), is in the default domain. None when malformed. (Rule files and the command
    line's --fp16-ops / --fp32-ops read op names alike.) ``"domain::Op"``, as the summary and report
    spell an op (``unlisted ops kept FP32: mydom::Foo``), reads the same: copied into a rule file it
    was a 'malformed op name'."""
    if name.count("::") == 1 and ":" not in name.replace("::", ""):
        name = name.replace("::", ":")
    domain, _, op = name.rpartition(":")
    if not op or ":" in domain:
        return None
    return _canonical_domain(domain), op


def _split_op_key(op_key: str, shown: str, key: str) -> tuple[str, str]:
    split = _split_op_name(op_key)
    if split is None:
        raise RuleFileError(shown, key, "malformed op name: write Op or \"domain:Op\"")
    return split


def _group_checked(entries: list[RuleEntry], shown: str) -> dict[tuple[str, str], tuple[RuleEntry, ...]]:
    """Group by (domain, op), refusing overlapping opset ranges: the category must be unique."""
    grouped: dict[tuple[str, str], list[RuleEntry]] = {}
    for entry in entries:
        group = grouped.setdefault((entry.domain, entry.op), [])
        clash = next((other for other in group if other.overlaps(entry)), None)
        if clash is not None:
            raise RuleFileError(shown, _entry_key(entry), _overlap_problem(entry, clash))
        group.append(entry)
    return {key: tuple(sorted(group, key=lambda e: e.since or 0)) for key, group in grouped.items()}


def _overlap_problem(entry: RuleEntry, clash: RuleEntry) -> str:
    where = f"[{clash.category.value}]"
    return (
        f"{entry.op} is also in {where} with an overlapping opset range "
        f"({_range_text(clash)} vs {_range_text(entry)}); give each entry a since/until range "
        "that does not overlap the other"
    )


def _parse_nodes(table: dict[str, Any], shown: str, base_name: str) -> tuple[NodeRule, ...]:
    rules: list[NodeRule] = []
    for key, value in table.items():
        if key not in NODE_KEYS:
            suggestion = "low" if key in TARGETS else _closest(key, NODE_KEYS)
            raise RuleFileError(shown, f"nodes.{key}", "unknown key", suggestion)
        precision = Precision.FP32 if key == "fp32" else Precision.LOW
        for pattern in _pattern_list(value, shown, f"nodes.{key}"):
            rules.append(NodeRule(pattern, precision, f"{base_name}: nodes.{key}"))
    return tuple(rules)


def _pattern_list(value: Any, shown: str, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise RuleFileError(shown, key, "must be a list of non-empty node name patterns")
    for pattern in value:
        problem = _pattern_problem(pattern)
        if problem:
            raise RuleFileError(shown, key, problem)
    return value


def _pattern_problem(pattern: str) -> str | None:
    if not pattern.startswith(_REGEX_PREFIX):
        return None
    try:
        _compiled(pattern[len(_REGEX_PREFIX) :])
    except re.error as exc:
        return f"invalid regular expression {pattern!r}: {exc}"
    return None


# --------------------------------------------------------------------------------------------
# Op-name validation
# --------------------------------------------------------------------------------------------


def _check_op_names(layer: _Layer, frontend: str, known_extra: set[str]) -> None:
    """Unknown op names are typos until proven otherwise; custom domains are the user's own."""
    for (domain, op), group in layer.entries.items():
        vocabulary = _vocabulary(frontend, domain, known_extra)
        if vocabulary is None or op in vocabulary:
            continue
        suggestion = _suggest(frontend, domain, op, vocabulary)
        problem = _UNKNOWN_OP[frontend] if not domain else f"unknown {domain} op"
        raise RuleFileError(str(layer.path), _entry_key(group[0]), problem, suggestion)


# the custom domains whose ops this tool knows in full (the kernel table's rows, onnxruntime's schemas)
_KNOWN_DOMAINS = ("com.microsoft", "ai.onnx.ml")


def _suggest(frontend: str, domain: str, op: str, vocabulary: Iterable[str]) -> str | None:
    """The spelling meant by an op name its domain does not have, as an entry is written: the same
    name in another domain this tool knows (``FusedMatMul`` is ``com.microsoft:FusedMatMul``, as
    onnxruntime's optimizer output names it in op_type alone; ``com.microsoft:Relu`` is ``Relu``)
    before the closest name in its own (which made ``FusedMatMul`` 'MatMul', a pin on every MatMul)."""
    same_case = {v.lower(): v for v in vocabulary}.get(op.lower())  # ('gelu' is Gelu, not com.microsoft:Gelu)
    if frontend == "onnx" and same_case is None:
        for other in (d for d in ("", *_KNOWN_DOMAINS) if d != domain):
            found = {k.lower(): k for k in _vocabulary(frontend, other) or ()}.get(op.lower())
            if found:
                return f"{other}:{found}" if other else found
    suggestion = same_case or _closest(op, vocabulary)
    return f"{domain}:{suggestion}" if suggestion and domain else suggestion


def _vocabulary(frontend: str, domain: str, extra: frozenset[str] | set[str] = frozenset()) -> frozenset[str] | None:
    """The op names an entry of ``domain`` must be one of, or None where any name goes."""
    return _known_ops(frontend) | extra if not domain else _known_domain_ops(frontend, domain)


@functools.lru_cache(maxsize=8)
def _known_domain_ops(frontend: str, domain: str) -> frozenset[str] | None:
    """The ops of a custom domain this tool knows in full (com.microsoft, ai.onnx.ml: the kernel
    table's rows and onnxruntime's registered schemas), or None for a domain that is the user's
    own: a misspelt com.microsoft op pinned nothing, silently."""
    if frontend != "onnx":
        return None
    names = set(kernels.known_ops(domain))
    if not names:
        return None
    from .frontends.onnx_loader import _ort_schemas

    names |= {op for d, op in _ort_schemas() if kernels.canonical_domain(d) == kernels.canonical_domain(domain)}
    return frozenset(names)


def _known_ops(frontend: str) -> frozenset[str]:
    if frontend == "onnx":
        return _known_onnx_ops()
    return _known_torch_ops()


@functools.lru_cache(maxsize=1)
def _known_onnx_ops() -> frozenset[str]:
    return frozenset(kernels.known_ops("")) | _ONNX_OPS_WITHOUT_KERNEL_ROWS


@functools.lru_cache(maxsize=1)
def _known_torch_ops() -> frozenset[str]:
    """Torch has no op registry we may import here: the built-in torch sets are the vocabulary."""
    names: set[str] = set()
    for name in builtin_names():
        layer = _builtin_layer(name)
        if layer.frontend == "torch":
            names |= layer.op_names()
    return frozenset(names)


# --------------------------------------------------------------------------------------------
# Command-line overrides
# --------------------------------------------------------------------------------------------


def _cli_layer(
    frontend: str, fp32_ops: list[str], low_ops: list[str], fp32_nodes: list[str], low_nodes: list[str]
) -> _Layer | None:
    if not (fp32_ops or low_ops or fp32_nodes or low_nodes):
        return None
    entries: dict[tuple[str, str], tuple[RuleEntry, ...]] = {}
    spelt: dict[tuple[str, str], str] = {}
    for flag, category, names in (
        (_CLI_FP32_OPS, Category.DENY, fp32_ops),
        (_CLI_LOW_OPS, Category.ALLOW, low_ops),
    ):
        for name in names:
            entry = _cli_entry(frontend, flag, category, name)
            key = (entry.domain, entry.op)
            if key in entries and entries[key][0].category is not category:  # (Softmax and ai.onnx:Softmax too)
                raise UsageError(f"{spelt[key]} and {name} name the same op in both {_CLI_FP32_OPS} and {_CLI_LOW_OPS}"
                                 if spelt[key] != name else f"{name} named in both {_CLI_FP32_OPS} and {_CLI_LOW_OPS}")
            entries[key] = (entry,)
            spelt[key] = name
    nodes = _cli_node_rules(fp32_nodes, Precision.FP32, _CLI_FP32_NODES)
    nodes += _cli_node_rules(low_nodes, Precision.LOW, _CLI_LOW_NODES)
    return _Layer(
        name="command-line",
        identity="cli",
        path=None,
        frontend=None,
        target=None,
        provider=None,
        extends=None,
        replace=False,
        entries=MappingProxyType(entries),
        nodes=nodes,
    )


def _cli_entry(frontend: str, flag: str, category: Category, name: str) -> RuleEntry:
    split = _split_op_name(name)
    if split is None and name.count(":") > 1:
        raise UsageError(f"{flag}: {name!r} is not an op: write OP or DOMAIN:OP (e.g. com.microsoft:FusedMatMul)")
    domain, op = split or ("", "")
    known = _vocabulary(frontend, domain)
    if not op or (known is not None and op not in known):
        suggestion = _suggest(frontend, domain, op, known or frozenset())
        hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
        raise UsageError(f"{flag}: unknown {frontend} op {name!r}{hint}")
    return RuleEntry(op, domain, category, f"command line: {flag}", flag)


class PinnedBy(str):
    """A node pattern another flag chose (``--auto-fp32``'s pins ride in ``fp32_nodes``): the
    decision names that flag as its source, not ``--fp32-nodes``, which the user never passed."""

    flag: str

    def __new__(cls, pattern: str, flag: str) -> "PinnedBy":
        made = super().__new__(cls, pattern)
        made.flag = flag
        return made


def _cli_node_rules(patterns: list[str], precision: Precision, flag: str) -> tuple[NodeRule, ...]:
    for pattern in patterns:
        problem = "empty node pattern" if not pattern else _pattern_problem(pattern)
        if problem:
            raise UsageError(f"{flag}: {problem}")
    return tuple(NodeRule(str(pattern), precision, getattr(pattern, "flag", flag)) for pattern in patterns)


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _canonical_domain(domain: str | None) -> str:
    """Rules store the default ONNX domain as ``""``, the way ONNX models spell it."""
    return "" if domain in (None, "", kernels.ONNX_DOMAIN) else domain


def _entry_key(entry: RuleEntry | NodeRule) -> str:
    return entry.source.rsplit(": ", 1)[-1]


def _upper(until: int | None) -> float:
    return float("inf") if until is None else until


def _newest_first_key(entry: RuleEntry) -> tuple[float, int]:
    return (_upper(entry.until), entry.since or 0)


def _range_text(entry: RuleEntry) -> str:
    low = "" if entry.since is None else str(entry.since)
    high = "" if entry.until is None else str(entry.until)
    return f"opsets {low or '*'}..{high or '*'}"


def _closest(word: str, choices: Iterable[str]) -> str | None:
    """The valid spelling meant: the same word in another case first ('relu' is Relu, not Selu),
    else the closest fuzzy match."""
    choices = list(choices)
    folded = {choice.lower(): choice for choice in choices}
    if word.lower() in folded:
        return folded[word.lower()]
    matches = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return matches[0] if matches else None


def _check_choice(what: str, value: str, choices: Sequence[str]) -> None:
    if value in choices:
        return
    suggestion = _closest(value, choices)
    hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
    raise UsageError(f"unknown {what} {value!r}: expected one of {', '.join(choices)}{hint}")


def _non_empty_str(value: Any, shown: str, key: str) -> str:
    if not isinstance(value, str):
        raise RuleFileError(shown, key, f"must be a string, got {_type_name(value)}")
    if not value.strip():
        raise RuleFileError(shown, key, "must not be empty")
    return value.strip()


def _bool(value: Any, shown: str, key: str) -> bool:
    if not isinstance(value, bool):
        raise RuleFileError(shown, key, f"must be true or false, got {_type_name(value)}")
    return value


def _opset(value: Any, shown: str, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RuleFileError(shown, key, f"must be an integer opset version, got {_type_name(value)}")
    if value < 1:
        raise RuleFileError(shown, key, f"must be an opset version >= 1, got {value}")
    return value


def _fp32_inputs(value: Any, shown: str, key: str) -> tuple[int | str, ...]:
    if not isinstance(value, list):
        problem = f"must be a list of input names or indices, got {_type_name(value)}"
        raise RuleFileError(shown, key, problem)
    for item in value:
        is_index = isinstance(item, int) and not isinstance(item, bool) and item >= 0
        is_name = isinstance(item, str) and bool(item)
        if not (is_index or is_name):
            raise RuleFileError(shown, key, f"{item!r} is neither an input name nor an index >= 0")
    return tuple(value)


def _type_name(value: Any) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a float",
        str: "a string",
        list: "an array",
        dict: "a table",
    }
    return names.get(type(value), type(value).__name__)


@functools.lru_cache(maxsize=256)
def _compiled(regex: str) -> re.Pattern[str]:
    return re.compile(regex)
