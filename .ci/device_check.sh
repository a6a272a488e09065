#!/usr/bin/env bash
# `edge0 doctor` on a machine where MLX's CUDA backend is installed (the project's device machine,
# where one is lent): the engine computes on the GPU stream and the readers write into slots
# while it computes; doctor checks that, and says which checks the GPU skips (the fast prefill,
# the reader core).
#
#   .ci/device_check.sh [MODEL]      # default: demo; the report goes to $OUT (or .) as JSON
#
# The device machine reaches no network: MLX's CUDA build (the `mlx-cuda-12` or `mlx-cuda-13`
# wheel, matching the driver's CUDA) must be installed in the Python it runs already, with edge0
# (`pip install -e .`). Exit status: doctor's (1 on a FAIL), 3 when there is no CUDA backend.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-.}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
if ! "$PYTHON" -c 'import mlx.core as mx, sys; sys.exit(0 if mx.cuda.is_available() else 1)'; then
    "$PYTHON" -c 'import mlx.core as mx; print("mlx", mx.__version__, "default device", mx.default_device())' || true
    echo "device_check: MLX's CUDA backend is not available in $PYTHON" >&2
    exit 3
fi
"$PYTHON" -c 'import mlx.core as mx; print("mlx", mx.__version__, "default device", mx.default_device(), mx.device_info())'
status=0
"$PYTHON" -m edge0_tui.cli doctor "${1:-demo}" || status=$?
"$PYTHON" -m edge0_tui.cli doctor "${1:-demo}" --quick --json > "$OUT/doctor.json" || true
exit "$status"
