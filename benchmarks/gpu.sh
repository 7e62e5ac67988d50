#!/usr/bin/env bash
# The first GPU run, in one command:
#
#   FASTDATA_REQUIRE_CUDA=1 ./benchmarks/gpu.sh            # tests, then every benchmark
#   FASTDATA_REQUIRE_CUDA=1 ./benchmarks/gpu.sh tests      # only the tests
#   ./benchmarks/gpu.sh bench                              # only the benchmarks
#
# 1. `python -m fastdata doctor`: the driver, the CUDA build, what each backend gets.
# 2. The whole test suite with FASTDATA_REQUIRE_CUDA set: every test marked `cuda` must run and pass
#    (a missing or unusable GPU, or a DALI/nvImageCodec that does not import, is a failure, not a skip;
#    tests needing more GPUs than FASTDATA_REQUIRE_CUDA says still skip), and every other test runs with CUDA present
#    (device=None means the GPU there). The log goes to benchmarks/results/tests-<tag>.txt.
# 3. bench_loaders.py, bench_training.py and bench_accuracy.py (MNIST time to 99%, from ./data when
#    MNIST is there), each writing benchmarks/results/<name>-cuda-<gpu>.{md,json,png}; then
#    bench_cache.py on the GPU (memory's cache built by nvImageCodec on the GPU against PIL threads and
#    a copy: the GPU build's speed is measured nowhere else; cache-cuda-<gpu>.*). bench_decode.py and
#    bench_pillow.py measure CPU decoders only and are not run here.
# A failing stage does not stop the later ones (their figures are still worth having); the exit status
# is non-zero when any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export FASTDATA_REQUIRE_CUDA=${FASTDATA_REQUIRE_CUDA:-1}
stage=${1:-all}
case "$stage" in all|tests|bench) ;; *) echo "usage: $0 [all|tests|bench]" >&2; exit 2 ;; esac

out=${OUT_DIR:-benchmarks/results}
mkdir -p "$out"
tag=$("$PY" -c "import sys; sys.path.insert(0, '.'); from benchmarks import common; print(common.machine_tag(common.machine_info()))")
if [[ "$tag" != cuda-* ]]; then
  echo "gpu.sh: torch sees no CUDA device here (tag '$tag'); \`$PY -m fastdata doctor\` says why" >&2
  "$PY" -m fastdata doctor >&2
  exit 1
fi
status=0
run() {  # run a stage, remember a failure, go on
  echo; echo "== $*"
  "$@" || { echo "gpu.sh: FAILED: $*" >&2; status=1; }
}

"$PY" -m fastdata doctor | tee "$out/doctor-$tag.txt"
if [[ "$stage" != bench ]]; then
  run bash -c "'$PY' -m pytest -q -rfEs -p no:cacheprovider 2>&1 | tee '$out/tests-$tag.txt'; exit \${PIPESTATUS[0]}"
fi
if [[ "$stage" != tests ]]; then
  run "$PY" benchmarks/bench_loaders.py --out "$out"
  run "$PY" benchmarks/bench_training.py --out "$out"
  run "$PY" benchmarks/bench_accuracy.py --out "$out"
  run "$PY" benchmarks/bench_cache.py --device cuda --contenders threads nvimgcodec --out "$out"
fi
echo; echo "gpu.sh: results in $out (tag $tag)$([[ $status != 0 ]] && echo '; some stages FAILED')"
exit $status
