"""Developer tools for amp-rewrite: the FP32 test-model corpus and an isolated onnxruntime runner.

Not part of the installed package; tests import these as ``tools.corpus`` and ``tools.ortrun``.
"""
