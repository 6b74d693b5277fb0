#!/usr/bin/env bash
# Set up (or reuse) the project's virtual environment in .venv: idempotent, fast when done.
#   - a CPU build of torch is installed only when the environment has no torch at all, so a
#     user's own torch (CUDA or not) is never replaced;
#   - the project itself is installed editable with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${AMP_REWRITE_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.amp-rewrite-installed"
want="$(cat pyproject.toml tools/dev-env.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >/dev/null
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    # CPU wheel: the unpinned torch (and plain torch==2.13.0 from PyPI, on Linux) would pull several
    # GB of CUDA packages. The local version +cpu comes from a wheel house or index that has it; else
    # from PyTorch's CPU index.
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0+cpu" 2>/dev/null \
        || "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
            --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[test]"
echo "$want" > "$stamp"
