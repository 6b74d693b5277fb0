"""Defaults of dynamic loss scaling, one set for both places that scale: the torch
:class:`~amp_rewrite.training.LossScaler` and the update an ONNX training graph computes in-graph
(:mod:`amp_rewrite.training_onnx`). Stdlib only, so the ONNX side never imports torch."""

INIT_SCALE = 2.0 ** 16  # torch.amp.GradScaler's initial scale
GROWTH_FACTOR = 2.0  # scale × this after GROWTH_INTERVAL finite steps
BACKOFF_FACTOR = 0.5  # scale × this after a step with inf/NaN gradients
GROWTH_INTERVAL = 2000
MIN_SCALE = 1.0
MAX_SCALE = 2.0 ** 24
