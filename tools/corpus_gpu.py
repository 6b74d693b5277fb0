"""Full-size models for the GPU latency rows of ``tools/bench.py``: BERT-base and ResNet-50.

The corpus (``tools/corpus.py``) keeps its transformers tiny so the CPU suite stays quick; on those,
a GPU's time goes to kernel launches and FP16 cannot show what it buys. These two have the published
sizes (BERT-base: 12 layers, hidden 768, sequence 128; ResNet-50: bottleneck stages 3-4-6-3 at
224×224), random weights from HF configs (no downloads), and are exported by the TorchScript exporter
at opset 17 with a dynamic batch axis. They are not in any corpus tier and are not cached: each is
100-440 MB.

    from tools.corpus_gpu import build, list_models
"""

from __future__ import annotations

import numpy as np

from tools.corpus import CorpusModel, _hf_wrapper, _normalise, _seed, _token_feeds, _torch_model, _TorchCase

_SEQ = 128
_BATCH = 2  # the feeds' batch; tools/bench.py repeats them to batch 1 and 32


def _bert_base() -> _TorchCase:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(num_labels=2, attn_implementation="eager", pad_token_id=0)  # bert-base's defaults
    ids, mask = _token_feeds(np.random.default_rng(_seed("bert-base")), _BATCH, _SEQ, cfg.vocab_size)
    feeds = {"input_ids": ids, "attention_mask": mask}
    model = _hf_wrapper(BertForSequenceClassification(cfg), list(feeds), lambda o: o.logits)
    dynamic = {k: {0: "batch"} for k in feeds}
    return _TorchCase(model, feeds, ["logits"], dynamic)


def _resnet50() -> _TorchCase:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_labels=1000)  # ResNet-50's layout is the config's default
    rng = np.random.default_rng(_seed("resnet50/pixels"))
    feeds = {"pixel_values": rng.standard_normal((_BATCH, 3, 224, 224), dtype=np.float32)}
    model = _hf_wrapper(ResNetForImageClassification(cfg), list(feeds), lambda o: o.logits)
    return _TorchCase(model, feeds, ["logits"], {"pixel_values": {0: "batch"}})


_MODELS = {"gpu/bert-base-torchscript-op17": _bert_base, "gpu/resnet50-torchscript-op17": _resnet50}


def list_models() -> list[str]:
    return list(_MODELS)


def build(name: str) -> CorpusModel:
    try:
        make = _MODELS[name]
    except KeyError:
        raise KeyError(f"unknown GPU model {name!r}; expected one of {list(_MODELS)}") from None
    cm = _torch_model(name, "hf", make, "torchscript", 17)
    _normalise(cm)
    return cm
