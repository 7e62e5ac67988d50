#!/usr/bin/env bash
# One cell of the dependency matrix: fastdata installed, without extras, into a fresh virtual environment
# made from PYTHON with the given pins, then the checks a user's first hour would make. It proves what
# pyproject.toml's floors promise (tests/test_qa_versions.py guards them cheaply in CI; this installs
# them for real). Not run by CI: each torch is a CUDA build from PyPI, 3-6 GB a cell.
#
#   tools/version_matrix.sh PYTHON VENV PIN...
#   tools/version_matrix.sh python3.10 /tmp/fd-floors torch==2.4.1 torchvision==0.19.1 numpy==1.25.2 \
#       pillow==9.1.0 tqdm==4.60.0
#
# docs/install.md lists the cells run so far and what each cost. A pip-wide constraints file (pip config
# list) can forbid the pins: PIP_CONSTRAINT=/dev/null lifts it for this run. Exit status: the number of
# checks that failed (0: all passed); the last lines are one line per check.
set -uo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,13p' "$0" >&2
  exit 2
fi
PYTHON=$1 VENV=$2
shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '%s\n' "$@" > "$work/pins.txt"
results=()
failed=0
check() {  # name, command...: run it, record the verdict and how long it took
  local name=$1 start=$SECONDS
  shift
  echo "=== $name" >&2
  if "$@"; then results+=("pass  $name ($((SECONDS - start)) s)")
  else results+=("FAIL  $name ($((SECONDS - start)) s)"); failed=$((failed + 1)); fi
}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || exit 1
PY=$VENV/bin/python
PIP=("$PY" -m pip --disable-pip-version-check -q)
# The pins first and on their own, so that pip's time and the download show apart from fastdata's.
check "install the pins" "${PIP[@]}" install -c "$work/pins.txt" torch torchvision numpy pillow tqdm pytest
# Then fastdata as a user gets it (no extras; not editable): pip must find the pins inside its floors.
check "pip install fastdata (no extras)" "${PIP[@]}" install -c "$work/pins.txt" "$repo"
"$PY" -c "import sys, torch, torchvision, numpy, PIL, tqdm; print('python', sys.version.split()[0], '| torch',
torch.__version__, '| torchvision', torchvision.__version__, '| numpy', numpy.__version__, '| PIL',
PIL.__version__, '| tqdm', tqdm.__version__)"

# From a folder outside the checkout, so that the installed package is the one imported.
cd "$work" || exit 1
check "import fastdata" "$PY" -c "import fastdata; print(fastdata.__version__, fastdata.available_backends())"
check "dali without the extra names it" "$PY" -c "
import numpy as np, fastdata
from fastdata.datasets import ArraySource
from fastdata.errors import MissingDependency
try:
    fastdata.make_loader(ArraySource(np.zeros((4, 8, 8), np.uint8), np.zeros(4, np.int64)), 'dali', batch_size=2)
except MissingDependency as e:
    assert 'fastdata[dali]' in str(e), e
    print(e)
else:
    raise SystemExit('backend dali built without DALI installed')"
for backend in torch memory prefetch auto; do
  check "train_mnist --backend $backend" "$PY" "$repo/examples/train_mnist.py" --backend "$backend" --epochs 1 \
    --data synthetic --data-root "$work/data" --train-size 2048 --test-size 512 --no-progress
done
cd "$repo" || exit 1
# No extras here: their tests skip, naming them (FASTDATA_REQUIRE_EXTRAS=0 also where CI=true).
check "tests" env FASTDATA_REQUIRE_EXTRAS=0 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests/test_qa_versions.py \
  tests/test_contract.py tests/test_torch_loader.py tests/test_sampling.py tests/test_checkpoint.py \
  tests/test_datasets.py tests/test_engine_amp.py tests/test_engine_step.py

echo
printf '%s\n' "${results[@]}"
exit "$failed"
