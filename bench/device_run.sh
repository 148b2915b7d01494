#!/usr/bin/env bash
# Issue 56's measurements on a borrowed GPU machine, in one command (docs/gpus.md, "The device run"):
#
#   bash bench/device_run.sh --wheels   # here, once: the wheels the machine lacks into .whl/ (git-ignored, carried)
#   bash bench/device_run.sh            # there (carry .whl, timeout_s 600): ~8 minutes, JSON and a log under $OUT
#   bash bench/device_run.sh --quick    # anywhere, on the tiny model: the same steps as a smoke test (CI runs it)
#
# The steps (each `python -m bench.gpu`, each with its own time limit, so one that fails or overruns leaves the
# others' results): the 0.74B "rss" model F16 with every section (exactness, the hop's parts, ms/token of one
# process and 2 stages, 512-token time to first token, kernels a token), then Q8_0 and Q4_K_M (speed and kernels),
# then F16 again with PP_BEAM=2 (2 stages only; the search runs while the stages warm up, its kernels cached).
# At most 560 s in all (DEVICE_RUN_BUDGET; a step gets what is left when that is less than its own limit), about 8
# minutes on an H200 (the quantized models generate while the F16 step runs); give the device tool 600 s.
# Files under $OUT: machine.txt, device.log (everything printed), gpu-f16.json, gpu-q8_0.json, gpu-q4_k_m.json,
# gpu-f16-beam2.json (6 of the 8 files the device tool brings back).
set -u
cd "$(dirname "$0")/.."
WHEELS=(tinygrad==0.13.0 gguf==0.19.0 pybase64==1.5.1 tokenizers==0.23.3 jinja2==3.1.6 markupsafe==3.0.4)

if [ "${1:-}" = "--wheels" ]; then  # the machine has Python 3.12 with numpy, pyyaml, requests, tqdm; no network
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
fi
QUICK=""
[ "${1:-}" = "--quick" ] && QUICK="--quick"
OUT="${OUT:-bench/results/device}"
mkdir -p "$OUT"
LOG="$OUT/device.log"
: > "$LOG"
say() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG" >&2; }

PY=python3
if [ -z "$QUICK" ] && ! python3 -c "import tinygrad" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 || { say "installing the wheels of .whl/ failed (bash bench/device_run.sh --wheels, here)"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD"
fi
[ -x .venv/bin/python ] && [ -n "$QUICK" ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1
if [ -z "$QUICK" ]; then export DEV="${DEV:-CUDA}"; fi
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  nproc
  $PY -c "import sys, tinygrad; from tinygrad import Device; print(sys.version.split()[0], 'tinygrad', tinygrad.__version__ if hasattr(tinygrad, '__version__') else '?', 'DEV', Device.DEFAULT)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt" >> "$LOG"

# the models (a model cannot travel): each generated once, side by side on the machine's cores, then reused; a step
# waits only for its own (the quantized ones take longest: ~2-4 minutes for Q4_K_M on one core)
PRESET=rss
[ -n "$QUICK" ] && PRESET=tiny
say "generating the $PRESET model F16, Q8_0, Q4_K_M and the exactness model"
declare -A gen
for dtype in F16 Q8_0 Q4_K_M; do
  $PY -c "from bench import models; models.ensure_model('$PRESET', dtype='$dtype', isolated=True)" >>"$LOG" 2>&1 &
  gen[$dtype]=$!
done
$PY -c "from bench import models; models.ensure_model('bench')" >>"$LOG" 2>&1 &
gen[bench]=$!
ready() { for key in "$@"; do wait "${gen[$key]}" || say "generating the $key model failed (see above)"; done; }

failed=0
BUDGET=${DEVICE_RUN_BUDGET:-560}  # seconds for the whole run: under the device tool's 600, leaving the files' return
step() {  # step SECONDS TAG ARGS...: one bench.gpu run, its table in the log, its JSON as gpu-TAG.json (rewritten
  local limit=$1 tag=$2  # after each section, so a step stopped at its limit keeps the sections it finished)
  shift 2
  local left=$((BUDGET - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then say "step $tag skipped: the run's ${BUDGET}s are spent"; failed=1; return; fi
  say "step $tag (at most ${limit}s): bench.gpu $QUICK $*"
  timeout -k 10 "$limit" $PY -m bench.gpu $QUICK --out "$OUT" --tag "$tag" "$@" >>"$LOG" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || { say "step $tag exited $rc"; failed=1; }
}
# --quick (CI): the quantized steps count kernels only (the F16 step runs every section, as on the GPU)
QSECTIONS=speed,kernels
[ -n "$QUICK" ] && QSECTIONS=kernels
ready F16 bench
step 240 f16 --sections speed,hop,exact,kernels  # speed first: what a step stopped at its limit keeps
ready Q8_0
step 75 q8_0 --dtype Q8_0 --sections $QSECTIONS --solo realize
ready Q4_K_M
step 75 q4_k_m --dtype Q4_K_M --sections $QSECTIONS --solo realize
if [ -z "$QUICK" ]; then  # a BEAM search on the CPU takes minutes even on the tiny model
  step 120 f16-beam2 --sections speed --beam 2
fi
say "done; files: $(ls "$OUT" | tr '\n' ' ')"
exit $failed
