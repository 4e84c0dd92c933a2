#!/usr/bin/env bash
# The real runs recorded in the README, sized for the project's 2-core CPU (about 2 h of training
# and 3.5 h of evaluation on a quiet machine): fine-tune the embedded SmolLM2-135M-Instruct on E2E dev
# (plain task prompt, batch 16, AdamW, cosine decay) with 2x, 1x, 3x and 5x schedules (and 2x, 3x for 150, 100 steps), then evaluate
# the checkpoints on the E2E test set (all 630 MRs unless LIMIT=N) with the stock-model sanity rows,
# the CALM-style baseline (batch 1; all MRs unless CALM_LIMIT=N) and CNN/DailyMail (80 articles).
#   bash benchmarks/cpu_real_runs.sh                 # everything
#   RUNS="1 3" EVAL=0 bash benchmarks/cpu_real_runs.sh
# Each command is runnable on its own; records land in benchmarks/results/, checkpoints in runs/.
set -uo pipefail
RUNS=${RUNS:-"2 1 3 5 2-150 3-100"}
EVAL=${EVAL:-1}
LIMIT=${LIMIT:-}
CALM_LIMIT=${CALM_LIMIT:-}   # empty: all 630 MRs (about 2.3 h at batch 1 here)
TR="python benchmarks/train_e2e.py --batch-size 16 --no-chat --threads 2 --eval-every 10 --checkpoint-every 10"
log() { echo "[$(date +%H:%M:%S)] $*"; }
for s in $RUNS; do
  case $s in
    1) $TR --speedup 1 --max-steps 40 --lr 1e-4 ;;   # the task alone is learnt fast at full depth
    2) python benchmarks/train_e2e.py --max-steps 60 --batch-size 16 --no-chat --threads 2 --eval-every 20 \
         --checkpoint-every 20 --no-progress --speedup 2 --lr 2e-4 ;;
    2-150) python benchmarks/train_e2e.py --max-steps 150 --batch-size 16 --no-chat --threads 2 --eval-every 25 \
         --checkpoint-every 25 --no-progress --speedup 2 --lr 2e-4 --tag 2x-150 ;;   # ~46 min
    3-100) python benchmarks/train_e2e.py --max-steps 100 --batch-size 16 --no-chat --threads 2 --eval-every 25 \
         --checkpoint-every 25 --no-progress --speedup 3 --lr 2e-4 --tag 3x-100 ;;   # ~20 min
    *) $TR --speedup $s --max-steps 40 --lr 2e-4 ;;
  esac
  log "trained ${s}x"
done
if [ "$EVAL" = 1 ]; then
  python benchmarks/eval_e2e.py --ckpt 1x=runs/e2e-1x/final --ckpt 2x=runs/e2e-2x/final --ckpt 3x=runs/e2e-3x/final \
    --ckpt 5x=runs/e2e-5x/final ${LIMIT:+--limit $LIMIT} --batch-size 32 --no-progress
  python benchmarks/plot_eval.py benchmarks/results/eval_e2e.json --name eval_e2e --rescore \
    --frontier 1x:full --frontier 2x:checkpoint --frontier 3x:checkpoint --frontier 5x:checkpoint
  python benchmarks/eval_e2e.py --ckpt 2x-150=runs/e2e-2x-150/final --no-stock ${LIMIT:+--limit $LIMIT} \
    --batch-size 32 --name eval_e2e_2x150 --no-progress
  python benchmarks/eval_e2e.py --ckpt 3x-100=runs/e2e-3x-100/final --no-stock ${LIMIT:+--limit $LIMIT} \
    --batch-size 32 --name eval_e2e_3x100 --no-progress
  python benchmarks/plot_eval.py benchmarks/results/eval_e2e.json benchmarks/results/eval_e2e_2x150.json \
    benchmarks/results/eval_e2e_3x100.json --name eval_e2e_longer \
    --frontier 1x:full --frontier 2x-150:checkpoint --frontier 3x-100:checkpoint --frontier 5x:checkpoint
  log "evaluated E2E"
  python benchmarks/eval_e2e.py --ckpt 1x=runs/e2e-1x/final --no-stock --calm-threshold 0.9 --batch-size 1 \
    ${CALM_LIMIT:+--limit $CALM_LIMIT} --name eval_e2e_calm${CALM_LIMIT:-630} --no-progress
  log "evaluated CALM"
  python benchmarks/eval_e2e.py --task cnndm --ckpt 2x=runs/e2e-2x/final --batch-size 16 --sort-by-length --no-progress
  log "evaluated CNN/DM"
fi
