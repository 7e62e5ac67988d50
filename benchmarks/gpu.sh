#!/usr/bin/env bash
# fastdata's GPU run: the CUDA tests and the GPU benchmarks, in three calls sized for the lent machine
# (../shared/gpu/README.md: one H200, 16 cores, `python3` 3.12 with torch and no .venv, at most 64 MiB
# carried per call, DALI complete only in the third call, files in the checkout not kept between calls,
# /var/tmp kept while the machine stays warm, 30 s between calls).
#
#   bash benchmarks/gpu.sh call1|call2|call3   # one call each, in this order (below)
#   bash benchmarks/gpu.sh all                 # the three in one go, on a GPU machine of your own with DALI
#   bash benchmarks/gpu.sh dry                 # every stage on the CPU, tiny sizes: do they run? (2-5 min)
#
# On the lent machine (the device tool), after ../shared/gpu/pack.sh, each call within 30 s of the last:
#   1. carry [".gpu/whl", ".gpu/setup.sh", ".gpu/dali.part0"]: source .gpu/setup.sh && bash benchmarks/gpu.sh call1
#   2. carry [".gpu/setup.sh", ".gpu/dali.part1"]: source .gpu/setup.sh && bash benchmarks/gpu.sh call2
#   3. carry [".gpu/setup.sh", ".gpu/dali.part2"]: source .gpu/setup.sh && bash benchmarks/gpu.sh call3
# then give_back; `tar -xzf gpu-reports-cuda-<gpu>.tar.gz -C benchmarks/results --strip-components=1 reports`
# puts the reports in place.
#
# Stages, each under `timeout` (its limit in seconds): one stuck stage is stopped (SIGINT first, so pytest
# still prints its summary), counted as failed, and the next one runs. The H200 run of 2026-11-27 took 9.5
# minutes of commands, 10.2 minutes of device time with the start (the limits add up to 17.6: bounds on a
# stuck stage, not the run's time).
# GPU_SH_LIMIT_PCT scales every limit (percent; `dry` 300).
# GPU_SH_STAGES="name:limit ..." runs these stages instead, in this order, as one call named after the mode:
# to fit a call into what is left of a device budget (the 2026-11-28 run: call3 as "dali-gpu:150
# dali-tests:210 dali-train:45", the benchmark first; call2 without cache).
# GPU_SH_DALI_BUDGET: bench_dali_gpu.py's --budget in seconds (default 150).
#   call1  doctor [30]      python -m fastdata doctor
#          tests [240]      FASTDATA_REQUIRE_CUDA=1 pytest -m cuda without the dali tests (no DALI yet:
#                           tests/test_dali.py fails at collection under FASTDATA_REQUIRE_CUDA, by design)
#   call2  jpegs [45]       the benchmarks' JPEG folders (1,500 and 1,920 photos) written by a process pool
#                           into /var/tmp, where call 3 finds them
#          training [90]    bench_training.py, digits and JPEGs: fit's images/s, data wait, GPU idle
#          loaders [60]     bench_loaders.py on digits: images/s of each backend against the tutorial pipeline
#          cache [90]       bench_cache.py on CUDA: memory's photo cache built by processes, threads, nvImageCodec
#   call3  dali-tests [240] FASTDATA_REQUIRE_CUDA=1 pytest -m cuda -k dali (setup says "DALI yes" by then)
#          dali-train [60] bench_training.py with dali alone, digits and JPEGs (the first command's data wait
#                           on dali; report training-<tag>-dali)
#          dali-gpu [200]   bench_dali_gpu.py: DALI's own pipeline, the dali backend's settings, torch, PIL
# Call 2's benchmarks leave DALI out (it is complete only in call 3), where dali-train
# trains on it and dali-gpu measures its settings on JPEGs.
#
# Where things go: every stage writes its log and report under $FASTDATA_GPU_KEEP (default
# /var/tmp/fastdata-gpu-run; `dry`: /var/tmp/fastdata-gpu-dry), which outlives the calls. At the end of each
# call: with $OUT set (the device tool returns at most 8 files from it), summary-<tag>.md (every stage so
# far: pass/fail, seconds, headline figures), gpu-reports-<tag>.tar.gz (all reports and logs so far) and this
# call's report .md/.txt files; without $OUT, the reports go to benchmarks/results/ (`dry`: $KEEP/out).
# The tag is cuda-<gpu> (cuda-h200); `dry` uses "dry". The exit status is non-zero when a stage of this call
# failed. PY: the interpreter (default .venv/bin/python where there is one, else python3).
set -uo pipefail
self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
cd "$(dirname "$self")/.."
if [[ -z ${PY:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PY
mode=${1:-all}

# --------------------------------------------------------------------------------------- the stages
# Sizes: the real run's, or the dry run's (tiny, on the CPU, pytest only collecting: on a CPU the CUDA
# tests would only skip).
# The dry run trains on digits only: SmallCNN on 224² photos runs at a few images/s on a CPU.
if [[ ${GPU_SH_DRY:-} == 1 || $mode == dry ]]; then
  DEV=(--device cpu); COLLECT=(--co); JPEGS=(40)
  TRAIN=(--quick --workloads digits --steps 1 --digits-batch 32); LOADERS=(--quick --digits 2000 --passes 1)
  CACHE=(--quick --photos 40); DALI_GPU=(--quick)
else
  DEV=(); COLLECT=(); JPEGS=(1500 1920)
  TRAIN=(--workloads digits jpeg); LOADERS=(--passes 3 --min-pass 0.5 --budget 15)
  CACHE=(--device cuda --passes 1); DALI_GPU=(--budget "${GPU_SH_DALI_BUDGET:-150}")
fi

bench() {  # a benchmark script with the run's folders and tag (BENCH_TAG: another tag, for a second report)
  local script=$1; shift
  "$PY" "benchmarks/$script" "$@" "${DEV[@]}" --cache "$KEEP/jpegs" --out "$KEEP/reports" --tag "${BENCH_TAG:-$TAG}"
}

cuda_tests() {  # pytest over the `cuda` tests; every one must run (FASTDATA_REQUIRE_CUDA) except in a dry run
  # -rP: the output of passing tests too (the memory 1% test prints where its data wait came from)
  # --durations: which tests spend the call's minutes (the stage limits are sized from them)
  local opts=(-q -rfEsP -m cuda -p no:cacheprovider --durations=25 "${COLLECT[@]}")
  if [[ ${#COLLECT[@]} == 0 ]] && "$PY" -c "import pytest_timeout" 2>/dev/null; then opts+=(--timeout 120); fi
  if [[ ${#COLLECT[@]} == 0 ]]; then
    FASTDATA_REQUIRE_CUDA=${FASTDATA_REQUIRE_CUDA:-1} "$PY" -m pytest "${opts[@]}" "$@"
  else
    env -u FASTDATA_REQUIRE_CUDA "$PY" -m pytest "${opts[@]}" "$@"
  fi
}

stage() {  # the body of one stage (run by `run_stage` in a child process, under timeout)
  case $1 in
    doctor) "$PY" -m fastdata doctor ;;
    # Every file of dali tests left out, not only test_dali.py: without DALI each fails at collection
    # under FASTDATA_REQUIRE_CUDA (by design), and the dry run, collecting without it, cannot see that (the
    # 2026-11-28 run spent a minute of its device time on test_decode_dali_outputs.py and test_qa_dali.py).
    tests) local ignore=(); for f in tests/*dali*.py; do ignore+=(--ignore "$f"); done
           cuda_tests "${ignore[@]}" -k "not dali" ;;
    jpegs) "$PY" -c 'import sys; sys.path.insert(0, "."); from benchmarks import common
for n in sys.argv[2:]: print(f"{n} photos: {common.photo_folder(sys.argv[1], int(n))}", flush=True)' \
             "$KEEP/jpegs" "${JPEGS[@]}" ;;
    training) bench bench_training.py --backends torch memory prefetch auto "${TRAIN[@]}" ;;
    loaders) bench bench_loaders.py --workloads digits --backends torch memory prefetch auto "${LOADERS[@]}" ;;
    cache) bench bench_cache.py --contenders processes threads nvimgcodec "${CACHE[@]}" ;;
    dali-tests) cuda_tests -k dali ;;
    dali-train) BENCH_TAG="$TAG-dali" bench bench_training.py --backends dali --no-baseline "${TRAIN[@]}" ;;
    dali-gpu) bench bench_dali_gpu.py "${DALI_GPU[@]}" ;;
    *) echo "gpu.sh: no stage '$1'" >&2; return 2 ;;
  esac
}

if [[ $mode == __stage ]]; then  # the child run_stage starts: KEEP and TAG come from its environment
  stage "$2"
  exit $?
fi

# Limits: the H200 run of 2026-11-27 took doctor 13 s, tests 136, jpegs 19, training 44, loaders 37,
# dali-tests 79 and dali-gpu 124 (the second run, 15:50: dali-tests reached its 120 s limit after 22 of
# its 25 tests, 116 s, all passed; 240 now, with the first command on dali and the EXIF cases added);
# cache (six builds, each a fresh process importing torch and nvImageCodec) ran out at 45 s in its fifth
# build, and dali-tests at 75 s after its last test. tests: 180 -> 240 with the CUDA review's tests
# (tests/test_qa_cuda_review.py: 9 more in call 1) and the 9 cuda tests added since that run.
# The run of 2026-11-28 (fourth): tests 147 s (145 tests), jpegs 17, training 39, loaders 35, dali-tests
# 150 (40 tests), dali-train 23, dali-gpu 115 at --budget 95; 714 s of device time in all, the start and
# a failed first call 1 included (GPU_SH_STAGES: cache left out, dali-gpu before dali-tests).
declare -A CALLS=([call1]="doctor:30 tests:240" [call2]="jpegs:45 training:90 loaders:60 cache:90"
                  [call3]="dali-tests:240 dali-train:60 dali-gpu:200")
case $mode in
  call1|call2|call3) calls=("$mode") ;;
  all|dry) calls=(call1 call2 call3) ;;
  *) echo "usage: $0 call1|call2|call3|all|dry" >&2; exit 2 ;;
esac
if [[ -n ${GPU_SH_STAGES:-} ]]; then   # these stages, in this order, as one call named after the mode
  known=" $(for c in call1 call2 call3; do for s in ${CALLS[$c]}; do printf '%s ' "${s%%:*}"; done; done)"
  for spec in $GPU_SH_STAGES; do
    if [[ $spec != *:* || $known != *" ${spec%%:*} "* || ! ${spec##*:} =~ ^[0-9]+$ ]]; then
      echo "gpu.sh: GPU_SH_STAGES: '$spec' is not NAME:SECONDS with NAME one of:$known" >&2; exit 2
    fi
  done
  calls=("$mode"); CALLS[$mode]=$GPU_SH_STAGES
fi

# ------------------------------------------------------------------------------------ the machine
if [[ $mode == dry ]]; then
  TAG=dry; KEEP=${FASTDATA_GPU_KEEP:-/var/tmp/fastdata-gpu-dry}; out=${OUT:-$KEEP/out}
  export GPU_SH_DRY=1
else
  KEEP=${FASTDATA_GPU_KEEP:-/var/tmp/fastdata-gpu-run}; out=${OUT:-benchmarks/results}
  TAG=$("$PY" -c "import sys; sys.path.insert(0, '.'); from benchmarks import common; print(common.machine_tag(common.machine_info()))")
  if [[ "$TAG" != cuda-* ]]; then
    echo "gpu.sh: torch sees no CUDA device here (tag '$TAG'); \`$PY -m fastdata doctor\` says why" >&2
    "$PY" -m fastdata doctor >&2
    exit 1
  fi
fi
export KEEP TAG
# A new run starts afresh (call1, all, dry); calls 2 and 3 add to what the earlier calls recorded.
[[ $mode == call2 || $mode == call3 ]] || rm -rf "$KEEP/stages.tsv" "$KEEP/logs" "$KEEP/reports"
mkdir -p "$KEEP/logs" "$KEEP/reports" "$KEEP/jpegs" "$out"

failed=0
# GPU_SH_LIMIT_PCT scales every limit (percent): the dry run's CPU stages get 3x, a slower machine may need more.
pct=${GPU_SH_LIMIT_PCT:-$([[ $mode == dry ]] && echo 300 || echo 100)}
run_stage() {  # run_stage CALL NAME LIMIT: the stage in a child under timeout, its output also in its log
  local call=$1 name=$2 limit=$(( $3 * pct / 100 > 0 ? $3 * pct / 100 : 1 )) t0=$SECONDS rc result
  echo; echo "== $call: $name (limit ${limit}s)"
  timeout -s INT -k 15 "$limit" bash "$self" __stage "$name" 2>&1 | tee "$KEEP/logs/$name.log"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) result=pass ;;
    124|137) result="timeout after ${limit}s"; failed=1 ;;
    *) result="FAIL (exit $rc)"; failed=1 ;;
  esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$call" "$name" "$result" "$((SECONDS - t0))" "$limit" >> "$KEEP/stages.tsv"
  case $name in   # the logs that are the stage's report
    doctor|tests|dali-tests) cp "$KEEP/logs/$name.log" "$KEEP/reports/$name-$TAG.txt" ;;
  esac
  echo "== $call: $name: $result in $((SECONDS - t0))s"
}

new=$(mktemp); touch "$new"   # what this call wrote is what is newer than this
for call in "${calls[@]}"; do
  for spec in ${CALLS[$call]}; do
    run_stage "$call" "${spec%%:*}" "${spec##*:}"
  done
done

# ------------------------------------------------------------------------------------ the results
echo
"$PY" benchmarks/gpu_summary.py --keep "$KEEP" --tag "$TAG" --out "$KEEP/reports" || failed=1
if [[ -n ${OUT:-} ]]; then   # the device tool returns at most 8 files: one tarball, and 7 of this call's md/txt
  tar -C "$KEEP" -czf "$out/gpu-reports-$TAG.tar.gz" reports logs stages.tsv
  mapfile -t fresh < <(find "$KEEP/reports" -maxdepth 1 -newer "$new" -name '*.md' | sort
                       find "$KEEP/reports" -maxdepth 1 -newer "$new" -name '*.txt' | sort)
  cp "${fresh[@]:0:7}" "$out/"   # the summary and the reports first; the logs are in the tarball too
else
  cp "$KEEP"/reports/* "$out/"
fi
rm -f "$new"
echo "gpu.sh: $mode done; $(ls "$out" | wc -l) file(s) in $out$([[ $failed != 0 ]] && echo '; some stages FAILED')"
exit $failed
