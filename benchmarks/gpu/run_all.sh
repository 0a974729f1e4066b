#!/usr/bin/env bash
# One GPU validation run, under 8 minutes on one H200 or H100: the GPU tests, the kernel
# benchmark, the checkpoint benchmark with the state on the GPU (stage 1 a D2H copy into pinned
# memory), a preflight `standard` pass, and a short training run of configs/gpt-1.3b.yaml
# (bf16, ZeRO engine, fused kernels) beside the same run with every mshpc optimisation off.
# Every result is a JSON line on stdout; logs go to stderr.
#
# It needs only python3 with torch on a GPU machine: the repository runs from its checkout
# (PYTHONPATH), nothing is installed or downloaded. Missing optional packages (DALI, submitit)
# only skip what needs them.
#
#   bash benchmarks/gpu/run_all.sh              # the real run (needs a CUDA GPU)
#   bash benchmarks/gpu/run_all.sh --dry-run    # every stage in a tiny form, on any machine
#
# Knobs (environment): MSHPC_PYTHON (default .venv/bin/python where it exists, else python3),
# MSHPC_GPU_STEPS (training steps, 20), MSHPC_STAGE_S (seconds one stage may take, 300: a lease
# is short, and one stage that hangs must not take the others' time with it).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${MSHPC_PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1

say() { echo "run_all: $*" >&2; }
stage() {  # stage NAME CMD...: run one stage, time it, keep going if it fails
  local name=$1 t0=$SECONDS rc=0; shift
  say "== $name"
  timeout --signal=INT --kill-after=15 "${MSHPC_STAGE_S:-300}" "$@" || rc=$?
  echo "{\"bench\": \"gpu_run_all\", \"stage\": \"$name\", \"exit_code\": $rc, \"wall_s\": $((SECONDS - t0)), \"dry_run\": $DRY}"
  FAILED=$((FAILED + (rc != 0)))
}
FAILED=0

if [ $DRY = 0 ] && ! $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  say "no CUDA GPU here; use --dry-run to check the script itself"; exit 2
fi
$PY -c 'import torch; print("{\"bench\": \"gpu_run_all\", \"torch\": \"%s\", \"device\": \"%s\"}" % (torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"))'

if [ $DRY = 1 ]; then
  TINY=(--config configs/tiny.yaml --steps 4 --set model.n_layer=2 --set model.seq_len=64)
  stage gpu_tests $PY -m pytest tests/gpu -q -x -p no:cacheprovider
  stage kernels $PY benchmarks/fused_kernels.py --rounds 1 --no-compile --only adamw
  stage checkpoint $PY benchmarks/checkpoint.py --gib 0.05 --rounds 1
  stage preflight $PY -m mshpc preflight --level quick
  stage train $PY benchmarks/gpu/train_compare.py "${TINY[@]}"
else
  stage gpu_tests $PY -m pytest tests/gpu -q -p no:cacheprovider
  stage kernels $PY benchmarks/fused_kernels.py --rounds 5 --device cuda
  stage checkpoint $PY benchmarks/checkpoint.py --device cuda --rounds 3
  stage preflight $PY -m mshpc preflight --level standard
  stage train $PY benchmarks/gpu/train_compare.py --steps "${MSHPC_GPU_STEPS:-20}" \
    --set train.micro_batch=4 --set train.grad_accum=1
fi
say "$FAILED stage(s) failed"
exit $((FAILED > 0))
