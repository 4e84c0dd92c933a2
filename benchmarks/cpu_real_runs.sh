#!/usr/bin/env bash
# The real runs recorded in the README, sized for the project's 2-core CPU (about 2 h in all):
# fine-tune the embedded SmolLM2-135M-Instruct on E2E dev with 2x, 1x, 3x and 5x schedules
# (60 optimizer steps of 16 examples each, plain task prompt), then evaluate them on E2E test.
#   bash benchmarks/cpu_real_runs.sh [STEPS]
# Each command below is also runnable on its own; results land in benchmarks/results/.
set -uo pipefail
STEPS=${1:-60}
TR="python benchmarks/train_e2e.py --max-steps $STEPS --batch-size 16 --no-chat --threads 2 --eval-every 20 --checkpoint-every 20 --no-progress"
log() { echo "[$(date +%H:%M:%S)] $*"; }
log "train 2x";  $TR --speedup 2 --lr 2e-4
log "train 1x";  $TR --speedup 1 --lr 5e-5
log "train 3x";  $TR --speedup 3 --lr 2e-4
log "train 5x";  $TR --speedup 5 --lr 2e-4
log "done training"
