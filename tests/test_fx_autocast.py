"""The torch rule files and the rewrite agree with CUDA torch.autocast, checked against autocast itself.

The oracle is derived programmatically, on a CPU-only torch build, from CUDA autocast's own
kernels, not from a hand-written table:

1. the op list is the dispatcher's: every op with a kernel registered for the ``AutocastCUDA``
   dispatch key (``torch._C._dispatch_get_registrations_for_dispatch_key``);
2. each op's policy is observed by running its AutocastCUDA kernel: autocast is switched on for
   "cuda" and the op is called on FakeTensors that claim to live on a CUDA device (they carry the
   AutocastCUDA key, no GPU is touched) under a TorchDispatchMode that sits below autocast and sees
   the casts it makes: FP32 inputs cast to the low type → ``lower_precision_fp``; low inputs
   computed in FP32 (a cast to float, a ``dtype=float32`` argument or an FP32 result) → ``fp32``
   (also fp32_set_opt_dtype / fp32_append_dtype); a low input widened to match an FP32 one →
   ``promote``; autocast raising "unsafe to autocast" → ``banned``;
3. per node, on whole models: an exported graph is replayed on fake CUDA tensors under autocast
   (torch.fx.Interpreter calls OpOverloads, which need no CUDA device guard), and each node's
   output dtype is compared with the same node's output dtype in the rewritten module.

Every disagreement is deliberate and listed below with its reason; the rule files say the same in
their entries' reasons.
"""

from __future__ import annotations

import functools
import logging

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from amp_rewrite.api import _dispatch  # noqa: E402
from amp_rewrite.rulebook import load_rules  # noqa: E402

from test_fx_rewrite import make  # noqa: E402

logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
AGREES = {"lower_precision_fp": {"allow"}, "fp32": {"deny"}, "promote": {"infer", "clear"}, "banned": {"deny"}}

_RANGE_ONLY = ("bf16 has FP32's exponent range (8 exponent bits), so exponentials, logarithms, powers and "
               "reciprocals overflow or underflow only where FP32 would; autocast's fp32 list protects fp16's "
               "range and applies it to bf16 unchanged. torch-bf16.toml puts them in infer.")
_GRID = ("grid_sampler's grid holds sampling coordinates: fp16 spacing is 1 pixel at 1024 (bf16: 8), so amp-rewrite "
         "keeps it FP32 where autocast promotes it to the widest input type")
EXPECTED_DISAGREEMENTS = {
    "fp16": {"grid_sampler": _GRID},
    "bf16": {"grid_sampler": _GRID, **{op: _RANGE_ONLY for op in (
        "exp", "expm1", "log", "log10", "log2", "log1p", "pow", "reciprocal", "rsqrt", "softplus", "sinh", "cosh")}},
}


# -- the oracle ------------------------------------------------------------------------------------------------------
class _Below(TorchDispatchMode):
    """Records every op that reaches the Python dispatch key, i.e. what autocast sends on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        record = [func, args, kwargs, None]
        self.calls.append(record)
        record[3] = func(*args, **kwargs)
        return record[3]


class _CudaAutocast:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __enter__(self):
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", self.dtype)

    def __exit__(self, *exc):
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", torch.float16)
        torch.clear_autocast_cache()


def _op(qualified: str):
    name, _, overload = qualified.split("::")[1].partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default")


def _required_args(op, dtypes: list[torch.dtype]) -> list:
    """Positional arguments up to the first one with a default: tensors 2x2 on "cuda"."""
    it = iter(dtypes)
    make_tensor = lambda: torch.empty(2, 2, device="cuda", dtype=next(it))  # noqa: E731
    args: list = []
    for a in op._schema.arguments:
        if a.has_default_value():
            break
        t = str(a.type)
        if t in ("Tensor", "Optional[Tensor]"):
            args.append(make_tensor())
        elif t in ("List[Tensor]", "List[Optional[Tensor]]"):
            args.append([make_tensor(), make_tensor()])
        elif t in ("int", "Optional[int]"):
            args.append(1)
        elif t in ("List[int]", "Optional[List[int]]"):
            args.append([1])
        elif t in ("float", "Optional[float]", "number", "Optional[number]"):
            args.append(1.0)
        elif t == "bool":
            args.append(False)
        elif t == "str":
            args.append("ij,jk->ik" if a.name == "equation" else "fro")
        else:
            raise TypeError(f"{op}: argument type {t}")
    return args


def _tensor_count(op) -> int:
    n = 0
    for a in op._schema.arguments:
        if a.has_default_value():
            break
        n += {"Tensor": 1, "Optional[Tensor]": 1, "List[Tensor]": 2, "List[Optional[Tensor]]": 2}.get(str(a.type), 0)
    return n


def _run_below_autocast(op, dtypes: list[torch.dtype], low: torch.dtype) -> tuple[list, Exception | None]:
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        args = _required_args(op, dtypes)
    below = _Below()
    error = None
    with _CudaAutocast(low):
        try:
            with fake, below:
                op(*args)
        except Exception as exc:  # noqa: BLE001 - garbage shapes fail after autocast has decided
            error = exc
    return below.calls, error


def _cast_to(calls, dtype) -> bool:
    return any(f is torch.ops.aten._to_copy.default and k.get("dtype") == dtype for f, _, k, _ in calls)


def _saw_fp32(calls) -> bool:
    for _, args, kwargs, out in calls:
        for x in tree_flatten((args, kwargs, out))[0]:
            if x is torch.float32 or (isinstance(x, torch.Tensor) and x.dtype == torch.float32):
                return True
    return False


def autocast_policy(qualified: str, low: torch.dtype = torch.float16) -> str:
    """What CUDA autocast does with this op, observed by running its AutocastCUDA kernel."""
    op = _op(qualified)
    n = _tensor_count(op)
    calls, error = _run_below_autocast(op, [torch.float32] * n, low)
    if error is not None and "unsafe to autocast" in str(error):
        return "banned"
    if _cast_to(calls, low):
        return "lower_precision_fp"
    calls, _ = _run_below_autocast(op, [low] * n, low)
    if _saw_fp32(calls):
        return "fp32"
    if n >= 2:
        calls, _ = _run_below_autocast(op, [low] + [torch.float32] * (n - 1), low)
        if _cast_to(calls, torch.float32):
            return "promote"
    return "unknown"


@functools.lru_cache(maxsize=None)
def autocast_lists(target: str) -> dict[str, str]:
    """{aten base name: policy} for every op CUDA autocast registers (overloads agree)."""
    policies: dict[str, str] = {}
    for qualified in sorted(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")):
        base = qualified.split("::")[1].split(".")[0]
        policy = autocast_policy(qualified, LOW[target])
        assert policies.get(base, policy) == policy, f"{qualified}: overloads disagree"
        policies[base] = policy
    return policies


# -- rule files vs autocast ------------------------------------------------------------------------------------------
def test_oracle_is_derived_from_the_dispatcher():
    lists = autocast_lists("fp16")
    assert len(lists) > 80  # torch 2.13: 119 overloads, ~110 base names
    assert "unknown" not in lists.values(), {k for k, v in lists.items() if v == "unknown"}
    # a few anchors, so a broken observation method cannot pass silently
    assert lists["mm"] == lists["linear"] == lists["conv2d"] == "lower_precision_fp"
    assert lists["softmax"] == lists["layer_norm"] == lists["exp"] == lists["sum"] == "fp32"
    assert lists["addcmul"] == lists["index_put"] == "promote"
    assert lists["binary_cross_entropy"] == "banned"
    assert "relu" not in lists and "add" not in lists  # unlisted: run in their input type
    assert autocast_lists("bf16") == lists  # CUDA autocast uses one set of lists for both types


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_rules_agree_with_cuda_autocast(target):
    book = load_rules(frontend="torch", target=target)
    disagreements: dict[str, str] = {}
    counts = {"agree": 0}
    for op, policy in autocast_lists(target).items():
        entry = book.lookup(op)
        assert entry is not None, f"{op} is on autocast's {policy} list but no torch-{target} rule names it"
        if entry.category.value in AGREES[policy]:
            counts["agree"] += 1
        else:
            disagreements[op] = f"autocast {policy}, rule {entry.category.value}"
    assert set(disagreements) == set(EXPECTED_DISAGREEMENTS[target]), disagreements
    for op in disagreements:  # the rule file says so too
        reason = book.lookup(op).reason.lower()
        assert "autocast" in reason or "fp32's exponent range" in reason, (op, reason)
    assert counts["agree"] + len(disagreements) == len(autocast_lists(target))


# -- per node, on whole models ------------------------------------------------------------------------------------------
def _first_float(out):
    for x in tree_flatten(out)[0]:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.dtype
    return None


class _Recorder(torch.fx.Interpreter):
    """Output dtype of every ATen call, by node name."""

    def __init__(self, gm):
        super().__init__(gm)
        self.seen: dict[str, tuple[str, torch.dtype | None]] = {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            self.seen[n.name] = (n.target.overloadpacket.__name__, _first_float(out))
        return out


class _FakeCudaReplay(_Recorder):
    """Replays an exported graph on fake CUDA tensors: weights and factories move to "cuda"."""

    def get_attr(self, target, args, kwargs):
        t = super().get_attr(target, args, kwargs)
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda") if isinstance(t, torch.Tensor) else t

    def call_module(self, target, args, kwargs):
        return None if target == "_guards_fn" else super().call_module(target, args, kwargs)

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten._assert_tensor_metadata.default:
            return None  # export's checks of the CPU capture (device, and types autocast changes)
        if isinstance(target, torch._ops.OpOverload) and target.overloadpacket is torch.ops.aten.to:
            # aten.to's composite kernel takes a CUDA device guard; every tensor here is on "cuda"
            # already, so only the dtype part matters
            dtype = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), args[0].dtype))
            return torch.ops.aten._to_copy.default(args[0], dtype=dtype)
        cuda = lambda v: torch.device("cuda") if isinstance(v, torch.device) and v.type == "cpu" else v  # noqa: E731
        return super().call_function(target, tuple(cuda(a) for a in args), {k: cuda(v) for k, v in kwargs.items()})


def autocast_node_dtypes(gm, inputs, low: torch.dtype) -> dict[str, tuple[str, torch.dtype | None]]:
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with _CudaAutocast(low), fake:
        fake_inputs = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda") for t in inputs]
        replay = _FakeCudaReplay(gm)
        replay.run(*fake_inputs)
    return replay.seen


def compare_with_autocast(model, inputs, target: str):
    """(agreeing on-list nodes, on-list disagreements, off-list differences)."""
    ep = torch.export.export(model, inputs)
    oracle = autocast_node_dtypes(ep.module(), inputs, LOW[target])
    rewritten = _dispatch(ep, target=target).model
    recorder = _Recorder(rewritten)
    with torch.no_grad():
        recorder.run(*inputs)
    lists = autocast_lists(target)
    agree, disagree, off_list = [], {}, {}
    for name, (op, dtype) in oracle.items():
        ours = recorder.seen.get(name, (op, None))[1]
        if op in lists:
            if ours == dtype:
                agree.append(name)
            else:
                disagree[name] = (op, dtype, ours)
        elif ours != dtype:
            off_list[name] = (op, dtype, ours)
    return agree, disagree, off_list


# Off-list ops run in whatever type reaches them under autocast; where amp-rewrite's painting
# chooses otherwise it is by design, not an autocast disagreement:
OFF_LIST_BY_DESIGN = {
    "embedding": "clear: follows its low-precision consumers, so the table is stored low (autocast keeps it FP32)",
    "transpose": "clear: moves data next to a low-precision op and follows it",
    "lstm": "infer in torch-*.toml (state rounding compounds over time steps): low only between low ops; CUDA "
            "autocast runs cuDNN RNNs (_cudnn_rnn, registered only in CUDA builds) in the low type",
}


@pytest.mark.parametrize("target", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "encoder", "lstm"])
def test_per_node_precision_matches_cuda_autocast(name, target):
    model, inputs = make(name)
    agree, disagree, off_list = compare_with_autocast(model, inputs, target)
    expected = EXPECTED_DISAGREEMENTS[target]
    unexpected = {k: v for k, v in disagree.items() if v[0] not in expected}
    assert not unexpected, unexpected
    assert agree, "no op on autocast's lists in this model?"
    assert {op for op, _, _ in off_list.values()} <= set(OFF_LIST_BY_DESIGN), off_list
