"""Write the small FP32 demo models that are committed under models/.

    python tools/make_models.py [--out models/]

They are corpus models (tools/corpus.py) small enough to commit (< 0.5 MB each),
so the README's ``amp-rewrite models/tiny_bert.onnx`` works on a fresh clone
without torch or transformers installed.  Builds are seeded, so re-running
produces byte-identical files for the same library versions.

    tiny_bert.onnx               BERT (2 layers, hidden 64) + classifier, TorchScript exporter,
                                 opset 17 (LayerNormalization); inputs input_ids / attention_mask
    transformer_block_op13.onnx  hand-written pre-LN transformer block, opset 13: decomposed
                                 LayerNorm, -1e9 additive causal mask, Erf GELU
    tiny_cnn.onnx                Conv + BatchNormalization + Relu + MaxPool (x2), GAP, Gemm
    control_flow.onnx            Loop with a carried FP32 state, ReduceSum scan output and a
                                 nested If (Tanh / Softmax branches)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.corpus import build_uncached  # noqa: E402

#: file name -> corpus model it is a copy of
MODELS = {
    "tiny_bert.onnx": "hf/bert-torchscript-op17",
    "transformer_block_op13.onnx": "synthetic/transformer-block-op13",
    "tiny_cnn.onnx": "synthetic/cnn-bn-op17",
    "control_flow.onnx": "control/loop",
}
MAX_BYTES = 512 * 1024  # commit-sized


def write_model(corpus_name: str, path: Path) -> bytes:
    """Build ``corpus_name`` and write it to ``path`` atomically; returns the bytes."""
    data = build_uncached(corpus_name).model.SerializeToString()
    if len(data) > MAX_BYTES:
        raise SystemExit(f"{path.name}: {len(data)} bytes is too large to commit (max {MAX_BYTES})")
    tmp = path.with_suffix(".onnx.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "models", help="output directory (default: models/)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for file_name, corpus_name in MODELS.items():
        data = write_model(corpus_name, args.out / file_name)
        digest = hashlib.sha256(data).hexdigest()[:12]
        print(f"{args.out / file_name}  {len(data) / 1024:7.1f} KiB  sha256 {digest}  ({corpus_name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
