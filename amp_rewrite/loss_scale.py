"""Defaults of dynamic loss scaling, one set for both places that scale: the torch
:class:`~amp_rewrite.training.LossScaler` and the update an ONNX training graph computes in-graph
(:mod:`amp_rewrite.training_onnx`). Stdlib only, so the ONNX side never imports torch."""

INIT_SCALE = 2.0 ** 16  # torch.amp.GradScaler's initial scale
GROWTH_FACTOR = 2.0  # scale × this after GROWTH_INTERVAL finite steps
BACKOFF_FACTOR = 0.5  # scale × this after a step with inf/NaN gradients
GROWTH_INTERVAL = 2000
MIN_SCALE = 1.0
MAX_SCALE = 2.0 ** 24


def loss_scaling_for(target: str, loss_scaling: object) -> bool:
    """Whether a training rewrite scales the loss: ``loss_scaling`` when given (True/False), else
    on for fp16 (its gradients flush to zero below 6e-8) and off for bf16 (FP32's exponent range:
    nothing underflows that would not in FP32; PRECISION.md, "Training")."""
    from .errors import UsageError

    if loss_scaling is None:
        return target != "bf16"
    if not isinstance(loss_scaling, bool):
        raise UsageError(f"loss_scaling={loss_scaling!r}: pass True, False or None (None: on for fp16, off for bf16)")
    return loss_scaling


def no_scaling_reason(target: str, how: str) -> str:
    """Why a training rewrite added no loss scaling, for its note; ``how`` names the option that
    adds it back (the API's or the CLI's spelling)."""
    if target == "bf16":
        return f"bf16 keeps FP32's exponent range, so gradients underflow no sooner than in FP32; {how} adds it"
    return "turned off: fp16 gradients below 6e-8 flush to zero"
