#!/usr/bin/env bash
# Make a virtual environment with PyTorch 2.13 (CPU) for bench/bench_loader.py's
# DataLoader baseline.  Usage: bash bench/setup-torch-venv.sh DIR [PYTHON]
#
# Idempotent: DIR/.installed marks a finished install, and a second run does
# nothing.  The venv sees the system's site-packages (as .venv and .venv-grain
# do), so every loader in the benchmark runs on the same numpy: Debian's 1.24,
# which Debian's petsc4py needs.  torch itself does not require numpy, so pip
# leaves it alone, and this venv never touches .venv anyway.
set -euo pipefail

dir=${1:?usage: setup-torch-venv.sh DIR [PYTHON]}
python=${2:-${PYTHON:-/usr/bin/python3}}

if [ -e "$dir/.installed" ]; then
    exit 0
fi
"$python" -m venv --system-site-packages "$dir"
"$dir/bin/pip" install -q --disable-pip-version-check torch==2.13.0
# The numpy torch sees must be the one the other loaders use.
"$dir/bin/python" - <<'PY'
import numpy, torch
t = torch.from_numpy(numpy.zeros(4, numpy.float32))  # numpy interop works
assert t.shape == (4,)
print(f"torch {torch.__version__} with numpy {numpy.__version__}")
PY
touch "$dir/.installed"
