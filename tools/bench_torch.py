"""Inference latency: amp-rewrite + torch.compile against torch.autocast + torch.compile.

    python tools/bench_torch.py                          # GPU if there is one, else CPU (and says so)
    python tools/bench_torch.py --target fp16 --size base --iters 100
    python tools/bench_torch.py --backend aot_eager --json bench.json

Models: a transformer encoder (embedding, nn.MultiheadAttention, LayerNorm, GELU MLP, LM head) and
a ResNet-style CNN (convolutions, BatchNorm, residual blocks). Variants, all on the same weights:

- ``fp32``: eager FP32 (the reference for errors and speedups);
- ``autocast+compile``: ``torch.compile(model, backend=B)`` called inside ``torch.autocast``;
- ``rewrite+compile``: ``torch.compile(model, backend="amp_rewrite", options={"target": T, "backend": B})``.

Each variant is warmed up (compilation included) and then timed per call; the table shows the
median and the interquartile range in milliseconds, the speedup over FP32 eager and the relative
error max|y - y_fp32| / max|y_fp32|. On a GPU calls are timed with torch.cuda.synchronize(). Without
a GPU the script runs on CPU, prints that no GPU was available, and defaults to BF16 and tiny
shapes (FP16 matmul on CPU is tens of times slower than FP32, so FP16 CPU numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import amp_rewrite.compile_backend  # noqa: E402,F401  registers backend="amp_rewrite"

SIZES = {
    # transformer: (vocab, d_model, heads, layers, batch, seq); cnn: (width, blocks, batch, image)
    "tiny": {"transformer": (100, 32, 2, 1, 2, 8), "cnn": (8, 1, 2, 16)},
    "small": {"transformer": (1000, 128, 4, 2, 4, 64), "cnn": (32, 2, 8, 32)},
    "base": {"transformer": (32000, 512, 8, 6, 8, 256), "cnn": (64, 4, 32, 112)},
}


class EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff1, self.ff2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        a, _ = self.attn(x, x, x, need_weights=False)
        x = self.ln1(x + a)
        return self.ln2(x + self.ff2(F.gelu(self.ff1(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(EncoderLayer(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(x + self.b2(self.c2(y)))


class CNN(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(*(Residual(width) for _ in range(blocks)))
        self.head = nn.Linear(width, 1000)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def build(name: str, size: str, device: torch.device):
    torch.manual_seed(0)
    if name == "transformer":
        vocab, d, heads, layers, batch, seq = SIZES[size]["transformer"]
        model = Transformer(vocab, d, heads, layers)
        inputs = (torch.randint(0, vocab, (batch, seq), device=device),)
    else:
        width, blocks, batch, image = SIZES[size]["cnn"]
        model = CNN(width, blocks)
        inputs = (torch.randn(batch, 3, image, image, device=device),)
    return model.to(device).eval(), inputs


def timed(fn, inputs, *, warmup: int, iters: int, cuda: bool) -> tuple[list[float], torch.Tensor]:
    with torch.inference_mode():
        for _ in range(warmup):
            out = fn(*inputs)
        if cuda:
            torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            out = fn(*inputs)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    return times, out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def bench_model(name: str, args, device: torch.device) -> list[dict]:
    cuda = device.type == "cuda"
    low = torch.float16 if args.target == "fp16" else torch.bfloat16
    model, inputs = build(name, args.size, device)
    rows = []
    fp32_times, ref = timed(model, inputs, warmup=args.warmup, iters=args.iters, cuda=cuda)
    rows.append(_row(name, "fp32 eager", fp32_times, None, ref, ref))

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=args.backend)

    def autocast_compiled(*xs):
        with torch.autocast(device.type, dtype=low):
            return compiled(*xs)

    times, out = timed(autocast_compiled, inputs, warmup=args.warmup, iters=args.iters, cuda=cuda)
    rows.append(_row(name, "autocast+compile", times, fp32_times, out, ref))

    torch._dynamo.reset()
    rewritten = torch.compile(model, backend="amp_rewrite", options={"target": args.target, "backend": args.backend})
    times, out = timed(rewritten, inputs, warmup=args.warmup, iters=args.iters, cuda=cuda)
    rows.append(_row(name, "rewrite+compile", times, fp32_times, out, ref))
    torch._dynamo.reset()
    return rows


def _row(model: str, variant: str, times: list[float], baseline: list[float] | None, out, ref) -> dict:
    median = statistics.median(times)
    q = statistics.quantiles(times, n=4) if len(times) >= 4 else [median, median, median]
    return {"model": model, "variant": variant, "median_ms": median, "iqr_ms": q[2] - q[0],
            "speedup_vs_fp32": (statistics.median(baseline) / median) if baseline else 1.0,
            "rel_err": rel_err(out, ref), "iters": len(times)}


def common_arguments(parser: argparse.ArgumentParser, sizes: dict) -> None:
    """--device, --target and --size, as this script and tools/bench_train.py take them."""
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--target", choices=("fp16", "bf16"), default=None,
                        help="low-precision type (default: fp16 on GPU, bf16 on CPU)")
    parser.add_argument("--size", choices=tuple(sizes), default=None, help="default: base on GPU, tiny on CPU")


def choose_device(args: argparse.Namespace) -> torch.device | None:
    """The device ``--device`` asks for (auto: the GPU if there is one), with ``args.target`` and
    ``args.size`` defaulted for it (FP16 and base on a GPU, BF16 and tiny on CPU); None, with a
    message on stderr, when it asks for a GPU there is not. Says so when the run falls back to CPU."""
    has_gpu = torch.cuda.is_available()
    if args.device == "cuda" and not has_gpu:
        print("error: --device cuda but no GPU is available", file=sys.stderr)
        return None
    device = torch.device("cuda" if (args.device in ("auto", "cuda") and has_gpu) else "cpu")
    on_gpu = device.type == "cuda"
    if not on_gpu:
        print("No GPU was available: running on CPU. CPU timings do not predict GPU speedups "
              "(no tensor cores; FP16 matmul on CPU is emulated and slow).")
    args.target = args.target or ("fp16" if on_gpu else "bf16")
    args.size = args.size or ("base" if on_gpu else "tiny")
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(parser, SIZES)
    parser.add_argument("--models", default="transformer,cnn")
    parser.add_argument("--backend", default="inductor", help="compiler behind both variants (inductor, aot_eager, ...)")
    parser.add_argument("--warmup", type=int, default=None, help="default: 10 on GPU, 3 on CPU")
    parser.add_argument("--iters", type=int, default=None, help="default: 50 on GPU, 10 on CPU")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)

    device = choose_device(args)
    if device is None:
        return 2
    on_gpu = device.type == "cuda"
    args.warmup = args.warmup if args.warmup is not None else (10 if on_gpu else 3)
    args.iters = args.iters if args.iters is not None else (50 if on_gpu else 10)
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"device: {name}; torch {torch.__version__}; target {args.target}; size {args.size}; "
          f"backend {args.backend}; warm-up {args.warmup}, timed {args.iters} calls (medians)")

    rows: list[dict] = []
    for model_name in [m.strip() for m in args.models.split(",") if m.strip()]:
        rows += bench_model(model_name, args, device)
    print(f"\n{'model':<12} {'variant':<18} {'median ms':>10} {'IQR ms':>8} {'vs fp32':>8} {'rel err':>9}")
    for r in rows:
        print(f"{r['model']:<12} {r['variant']:<18} {r['median_ms']:>10.3f} {r['iqr_ms']:>8.3f} "
              f"{r['speedup_vs_fp32']:>7.2f}x {r['rel_err']:>9.2e}")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "gpu": on_gpu, "target": args.target, "size": args.size,
                                         "backend": args.backend, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
