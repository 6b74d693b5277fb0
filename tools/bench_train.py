"""Training: amp-rewrite's training rewrite against torch.autocast + GradScaler, on the same data.

    python -m tools.bench_train                              # GPU if there is one, else CPU (and says so)
    python -m tools.bench_train --target fp16 --size base --steps 200
    python -m tools.bench_train --json train.json

Model: ``tools/bench_torch.py``'s transformer (embedding, nn.MultiheadAttention, LayerNorm, GELU MLP,
LM head) with a cross-entropy loss, learning a task it can learn in a few hundred steps (each token's
successor is fixed by one random permutation of the vocabulary). Variants, all from the same initial weights, on the same batches,
with the same AdamW settings:

- ``fp32``: eager FP32 (the reference);
- ``autocast+GradScaler``: the forward under ``torch.autocast``, ``torch.amp.GradScaler`` (FP16 only);
- ``rewrite+LossScaler``: ``amp_rewrite.rewrite(model, training=True)`` (FP32 master weights, the
  loss-scale node in the graph) and ``amp_rewrite.LossScaler`` (FP16; BF16 trains with a plain loop).

Printed per variant: median milliseconds per step (forward, backward, optimizer step) and its
interquartile range, speed-up over FP32, the mean loss over the first and the last tenth of the
steps (the true loss: a scaled loss is divided by the scale its forward applied), the last-tenth
loss's relative difference from FP32's, the steps skipped for inf/NaN gradients and the loss scale at
the end. On a GPU each step is timed with torch.cuda.synchronize(); without one the script runs on
CPU, says so, and defaults to BF16 and tiny shapes (FP16 CPU timings mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import amp_rewrite  # noqa: E402
from tools.bench_torch import Transformer, choose_device, common_arguments  # noqa: E402

SIZES = {  # (vocab, d_model, heads, layers, batch, seq)
    "tiny": (64, 32, 2, 1, 8, 16),
    "small": (512, 128, 4, 2, 16, 64),
    "base": (8192, 768, 12, 6, 32, 512),  # GPU-bound on an H100 (smaller sizes time kernel launches)
}
LR = {"tiny": 1e-2, "small": 1e-3, "base": 3e-4}  # AdamW, no warm-up: what each size learns at


class WithLoss(nn.Module):
    """The transformer and its next-token cross-entropy: the loss is the module's one output."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, targets):
        logits = self.model(ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(size: str, steps: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of token chains that follow one fixed random permutation of the vocabulary
    (each token's successor is ``perm[token]``) from random first tokens, with their next-token
    targets: a task every variant learns within a few hundred steps, the loss falling from
    ln(vocab) towards 0, where a precision loss would show as a gap to FP32."""
    vocab, _, _, _, batch, seq = SIZES[size]
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(vocab, generator=g)
    out = []
    for _ in range(steps):
        ids = torch.empty(batch, seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(seq):
            ids[:, t + 1] = perm[ids[:, t]]
        out.append((ids[:, :-1].to(device), ids[:, 1:].to(device)))
    return out


def train(variant: str, base: nn.Module, data, low: torch.dtype, lr: float, cuda: bool) -> dict:
    model = copy.deepcopy(base)
    scale_of = None
    if variant == "fp32":
        module, opt = model, torch.optim.AdamW(model.parameters(), lr=lr)

        def step(ids, tgt):
            loss = module(ids, tgt)
            loss.backward()
            opt.step()
            return loss.detach()
    elif variant == "autocast+GradScaler":
        module, opt = model, torch.optim.AdamW(model.parameters(), lr=lr)
        scaler = torch.amp.GradScaler(data[0][0].device.type, enabled=low == torch.float16)
        scale_of = scaler.get_scale

        def step(ids, tgt):
            with torch.autocast(ids.device.type, dtype=low):
                loss = module(ids, tgt)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach().float()
    else:
        target = "fp16" if low == torch.float16 else "bf16"
        module = amp_rewrite.rewrite(model, example_inputs=data[0], target=target, training=True)
        opt = torch.optim.AdamW(module.parameters(), lr=lr)
        scaler = amp_rewrite.LossScaler(module, enabled=low == torch.float16)
        scale_of = scaler.get_scale

        def step(ids, tgt):
            loss = module(ids, tgt)
            applied = float(getattr(module, "amp_loss_scale", 1.0))
            scaler.backward(loss)
            scaler.step(opt)
            return loss.detach().float() / applied

    module.train()
    times, losses, skipped = [], [], 0
    for ids, tgt in data:
        before = scale_of() if scale_of else None
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(ids, tgt)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(float(loss))
        if scale_of and scale_of() < before:
            skipped += 1
    return {"variant": variant, "times": times, "losses": losses, "skipped": skipped,
            "final_scale": scale_of() if scale_of else None}


def summarise(run: dict, ref: dict | None) -> dict:
    """``run``'s row of the table; ``ref`` is FP32's row (None for FP32's own)."""
    n = max(1, len(run["losses"]) // 10)
    timed = run["times"][min(5, len(run["times"]) - 1):]  # the first steps compile kernels and warm caches
    median = statistics.median(timed)
    q = statistics.quantiles(timed, n=4) if len(timed) >= 4 else [median] * 3
    first, last = statistics.fmean(run["losses"][:n]), statistics.fmean(run["losses"][-n:])
    return {"variant": run["variant"], "median_ms": median, "iqr_ms": q[2] - q[0], "first_loss": first,
            "last_loss": last, "skipped": run["skipped"], "final_scale": run["final_scale"],
            "finite": all(math.isfinite(v) for v in run["losses"]),
            "speedup_vs_fp32": ref["median_ms"] / median if ref else 1.0,
            "last_loss_rel_diff": abs(last - ref["last_loss"]) / abs(ref["last_loss"]) if ref else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(parser, SIZES)
    parser.add_argument("--steps", type=int, default=None, help="default: 200 on GPU, 40 on CPU")
    parser.add_argument("--lr", type=float, default=None, help="default: 1e-2 tiny, 1e-3 small, 3e-4 base")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows and loss curves as JSON")
    args = parser.parse_args(argv)

    device = choose_device(args)
    if device is None:
        return 2
    on_gpu = device.type == "cuda"
    target, size = args.target, args.size
    steps = args.steps or (200 if on_gpu else 40)
    if steps < 10:
        print("error: --steps must be at least 10 (the table compares tenths of the run)", file=sys.stderr)
        return 2
    low = torch.float16 if target == "fp16" else torch.bfloat16
    args.lr = args.lr or LR[size]
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"device: {name}; torch {torch.__version__}; target {target}; size {size} {SIZES[size]}; "
          f"{steps} AdamW steps at lr {args.lr:g}")

    vocab, d, heads, layers, _, _ = SIZES[size]
    torch.manual_seed(0)
    base = WithLoss(Transformer(vocab, d, heads, layers)).to(device)
    data = batches(size, steps, device)
    runs = [train(v, base, data, low, args.lr, on_gpu) for v in ("fp32", "autocast+GradScaler", "rewrite+LossScaler")]
    rows = [summarise(runs[0], None)]
    rows += [summarise(r, rows[0]) for r in runs[1:]]
    print(f"\n{'variant':<22} {'ms/step':>9} {'IQR':>7} {'vs fp32':>8} {'first loss':>10} {'last loss':>10} "
          f"{'vs fp32':>8} {'skipped':>7} {'scale':>8}")
    for r in rows:
        scale = "-" if r["final_scale"] is None or low != torch.float16 else f"{r['final_scale']:g}"
        print(f"{r['variant']:<22} {r['median_ms']:>9.2f} {r['iqr_ms']:>7.2f} {r['speedup_vs_fp32']:>7.2f}x "
              f"{r['first_loss']:>10.4f} {r['last_loss']:>10.4f} {r['last_loss_rel_diff']:>8.1e} "
              f"{r['skipped']:>7} {scale:>8}")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "gpu": on_gpu, "target": target, "size": size,
                                         "steps": steps, "rows": rows,
                                         "losses": {r["variant"]: r["losses"] for r in runs}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
