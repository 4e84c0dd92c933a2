#!/usr/bin/env bash
# The real runs recorded in the README, sized for the project's 2-core CPU (about 1 h 30 min on a quiet machine):
# fine-tune the embedded SmolLM2-135M-Instruct on E2E dev (plain task prompt, batch 16, AdamW,
# cosine decay) with 2x, 1x, 3x and 5x schedules, then evaluate the checkpoints on the first
# LIMIT MRs of the E2E test set with the stock-model sanity rows.
#   bash benchmarks/cpu_real_runs.sh                 # everything
#   RUNS="1 3" EVAL=0 bash benchmarks/cpu_real_runs.sh
# Each command is runnable on its own; records land in benchmarks/results/, checkpoints in runs/.
set -uo pipefail
RUNS=${RUNS:-"2 1 3 5"}
EVAL=${EVAL:-1}
LIMIT=${LIMIT:-100}
TR="python benchmarks/train_e2e.py --batch-size 16 --no-chat --threads 2 --eval-every 10 --checkpoint-every 10"
log() { echo "[$(date +%H:%M:%S)] $*"; }
for s in $RUNS; do
  case $s in
    1) $TR --speedup 1 --max-steps 40 --lr 1e-4 ;;   # the task alone is learnt fast at full depth
    2) $TR --speedup 2 --max-steps 60 --lr 2e-4 ;;
    *) $TR --speedup $s --max-steps 40 --lr 2e-4 ;;
  esac
  log "trained ${s}x"
done
if [ "$EVAL" = 1 ]; then
  python benchmarks/eval_e2e.py --ckpt 1x=runs/e2e-1x/final --ckpt 2x=runs/e2e-2x/final --ckpt 3x=runs/e2e-3x/final \
    --ckpt 5x=runs/e2e-5x/final --limit $LIMIT --batch-size 32 --no-progress
  log "evaluated"
fi
