#!/usr/bin/env bash
# The device check (issue 42): one command on a lent GPU machine; the same script on the CPU.
#
#   benchmarks/device_check.sh [device_check.py options]          # on the GPU machine (PYTHON=python3 there)
#   DEVICE=cpu benchmarks/device_check.sh --quick                   # here, and in the test suite
#
# It runs the CUDA tests (pytest -m cuda; skipped without a GPU), then benchmarks/device_check.py,
# which prints one table (docs/benchmarks.md, "The device check"). What the GPU machine lacks travels
# in ignored folders .devcarry*/ (benchmarks/device_carry.sh fills them, 64 MiB a call): wheels are
# installed into a private folder, and a wheel sent in pieces (NAME.whl.partIofN, one per call) is
# joined once all N pieces are there. Environment: PYTHON (default .venv/bin/python), DEVICE
# (default cuda), OUT (default ./device-check; on the GPU machine the tool's $OUT), TESTS=0 (skip the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-device-check}
mkdir -p "$OUT"

if compgen -G ".devcarry*/*" >/dev/null; then
  wheels=/tmp/adaptive-wheels site=/tmp/adaptive-site
  mkdir -p "$wheels" "$site"
  cp -n .devcarry*/*.whl "$wheels"/ 2>/dev/null || true
  for first in .devcarry*/*.whl.part1of*; do
    [ -e "$first" ] || continue
    name=$(basename "${first%.part1of*}"); n=${first##*.part1of}
    pieces=(); for i in $(seq 1 "$n"); do p=$(compgen -G ".devcarry*/$name.part${i}of$n" | head -n 1) || true; [ -n "$p" ] && pieces+=("$p"); done
    if [ "${#pieces[@]}" -eq "$n" ]; then cat "${pieces[@]}" > "$wheels/$name"; else echo "device_check: $name: ${#pieces[@]} of $n pieces here" >&2; fi
  done
  if compgen -G "$wheels/*.whl" >/dev/null && [ "$(ls "$wheels")" != "$(cat "$site/.wheels" 2>/dev/null)" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$wheels"/*.whl
    ls "$wheels" > "$site/.wheels"  # installed: a later call with the same wheels skips this
  fi
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DEVICE" != cpu ] && [ "${TESTS:-1}" != 0 ]; then  # TESTS=0: a second call of one check
  "$PYTHON" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
PY
  set +e
  "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider tests/engine 2>&1 | tail -n 25
  set -e
fi
exec "$PYTHON" benchmarks/device_check.py --device "$DEVICE" --out "$OUT" "$@"
