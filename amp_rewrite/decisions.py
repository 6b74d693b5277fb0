"""Shared vocabulary of the passes: rule categories, precisions, and decision records.

A decision is a value with a reason, never a silent boolean: the report answers "why is this
node fp32?" from these records alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .ir import DType


class Category(str, enum.Enum):
    ALLOW = "allow"
    INFER = "infer"
    CLEAR = "clear"
    DENY = "deny"
    UNLISTED = "unlisted"  # no rule names the op: treated as deny and reported


# The summary's "MatMul/Gemm/Conv/attention" headline: every op the built-in ONNX rule files allow
# (a test keeps the two in step) and torch's GEMM, convolution and attention ops.
_CONTRIB_HEAVY = ("Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention",
                  "PackedMultiHeadAttention", "DecoderMaskedMultiHeadAttention", "DecoderMaskedSelfAttention",
                  "LongformerAttention", "DecoderAttention", "SparseAttention", "PagedAttention", "FusedMatMul",
                  "TransposeMatMul", "NhwcConv", "MatMulNBits", "MatMulBnb4", "MoE", "QMoE",
                  "MatMulBlockQuantizedFp4Weight", "MatMulBlockQuantizedFp8Weight")
# torch: every op the built-in torch rule files allow except prelu (a per-channel multiply), and
# the whole-sequence RNNs (their gate GEMMs)
_TORCH_HEAVY = ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "addr", "mv", "chain_matmul",
                "multi_dot", "linalg_multi_dot", "linalg_vecdot", "einsum", "conv1d", "conv2d", "conv3d", "conv_tbc",
                "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "convolution", "_convolution",
                "cudnn_convolution", "cudnn_convolution_transpose", "scaled_dot_product_attention",
                "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention", "multi_head_attention", "_native_multi_head_attention",
                "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_thnn_fused_lstm_cell",
                "_thnn_fused_gru_cell", "lstm", "gru", "rnn_tanh", "rnn_relu")
# onnxruntime's CPU-only convolutions its ENABLE_ALL optimisation saves (optimize_model(opt_level=99))
# and its fused GEMM/convolution: no low kernel, kept FP32 where met, and counted as kept so
_ORT_HEAVY = ("com.microsoft.nchwc::Conv", "com.microsoft::FusedConv", "com.microsoft::FusedGemm")
HEAVY_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention",
             *(f"com.microsoft::{op}" for op in _CONTRIB_HEAVY), *_ORT_HEAVY, *_TORCH_HEAVY}

# Ops whose low-precision speed depends on dims being multiples of 8 (tensor cores), and the
# positions of the two inputs whose shapes give those dims: (A, B) of a GEMM, (X, W) of a
# convolution. torch's addmm and baddbmm take the bias first.
ALIGNMENT_OPS: dict[str, tuple[int, int]] = {
    "MatMul": (0, 1), "Gemm": (0, 1), "Conv": (0, 1), "ConvTranspose": (0, 1),
    "linear": (0, 1), "matmul": (0, 1), "mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2),
    "conv1d": (0, 1), "conv2d": (0, 1), "conv3d": (0, 1), "conv_transpose1d": (0, 1), "conv_transpose2d": (0, 1),
    "conv_transpose3d": (0, 1), "convolution": (0, 1), "_convolution": (0, 1)}


class Precision(str, enum.Enum):
    LOW = "low"  # the target type: fp16 or bf16
    FP32 = "fp32"
    NONE = "none"  # no FP32 float tensor in its painted type group: nothing to decide


@dataclass
class Decision:
    """Why one node ended in its precision. ``via`` names the node the paint came from."""

    node: str
    op: str
    category: Category
    precision: Precision
    reason: str
    source: str  # the rule entry ("rules/onnx-cuda-fp16.toml: deny.ReduceMean") or the step
    step: str = "classify"  # classify | allow | deny-spread | between-allow | clear-spread | safety | override
    via: str | None = None
    island: int | None = None


@dataclass
class CastRecord:
    """One inserted (or retargeted) Cast."""

    name: str
    tensor: str
    src: str  # dtype short name
    dst: str
    producer: str | None
    consumers: list[str]
    shape: tuple | None
    numel: int | None
    scope: str
    reason: str
    kind: str = "inserted"  # inserted | retargeted | removed
    # times it runs per model run: 1, or in a Loop/Scan body the product of the trip counts around
    # it; None where one is not known statically (a Loop with a condition or a computed count)
    runs: int | None = 1

    @property
    def bytes_per_run(self) -> int | None:
        if self.numel is None or self.runs is None:
            return None
        return int(self.numel * (_itemsize(self.src) + _itemsize(self.dst)) * self.runs)


def _itemsize(short: str) -> float:
    """Bytes per element of a dtype's short name ("fp16", "int64"); 4 for one it does not know."""
    try:
        return DType.from_short(short).itemsize
    except KeyError:
        return 4


@dataclass
class Island:
    """A connected FP32 region that painting forced (a deny seed plus what deny paint pulled in)."""

    id: int
    scope: str
    members: list[str]
    seeds: list[str]
    pattern: str | None
    casts_in: int = 0
    casts_out: int = 0


@dataclass
class FusionRecord:
    """A decomposed pattern replaced by one fused op (a normalisation, the tanh-GELU)."""

    node: str  # the fused node's name
    op: str  # its op ("LayerNormalization", "com.microsoft::SkipLayerNormalization", ...)
    pattern: str  # LayerNorm | RMSNorm | tanh-GELU
    members: list[str]  # labels of the nodes it replaced
    reason: str
    casts: int = 0  # how many of them were the model's own Casts (gone with the pattern)


@dataclass
class WeightStats:
    converted: int = 0
    converted_elements: int = 0
    clamped: int = 0
    flushed_to_zero: int = 0
    sentinels: list[dict] = field(default_factory=list)
    duplicated: int = 0
    bytes_before: int = 0
    bytes_after: int = 0


@dataclass
class DecisionLog:
    """Everything the pipeline decided, in one place; the report is built from it."""

    target: str = "fp16"
    decisions: dict[str, Decision] = field(default_factory=dict)
    casts: list[CastRecord] = field(default_factory=list)
    islands: list[Island] = field(default_factory=list)
    fusions: list[FusionRecord] = field(default_factory=list)
    unlisted_ops: dict[str, int] = field(default_factory=dict)
    weights: WeightStats = field(default_factory=WeightStats)
    notes: list[str] = field(default_factory=list)
    io_changed: list[str] = field(default_factory=list)
    # Input shapes of the ALIGNMENT_OPS nodes (dims: int, symbolic str or None), for the report's
    # tensor-core alignment check.
    operand_shapes: dict[str, list] = field(default_factory=dict)

    def decide(self, decision: Decision) -> None:
        self.decisions[decision.node] = decision
