"""Run a BF16 model's numerics on onnxruntime's CPU provider, which has Cast kernels for bfloat16
but no bfloat16 MatMul/Gemm/Add/... kernels (session creation fails with NOT_IMPLEMENTED).

``emulate_bf16(model)`` returns an FP32 model that computes what the BF16 model computes on a GPU
whose kernels read and write bfloat16 and compute in FP32 internally: every tensor the model holds
in bfloat16 is rounded to bfloat16 where it is made and carried as FP32. It is
``amp_rewrite.emulate.emulate_low`` (which ``--check`` uses on the CPU provider), for BF16.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from amp_rewrite.emulate import emulate_low


def emulate_bf16(model: onnx.ModelProto) -> onnx.ModelProto:
    return emulate_low(model, TensorProto.BFLOAT16)[0]
