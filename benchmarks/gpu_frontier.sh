#!/usr/bin/env bash
# The equal-budget frontier on one GPU in about 10 minutes (issue 9 section 4): 1x, 2x, 3x and 5x
# fine-tunes of SmolLM2-135M-Instruct on E2E dev, each for the same number of examples (EPOCHS,
# default 5 epochs, cut equally for all models when the time does not allow it), bf16 autocast,
# then their evaluation on the 630 E2E test MRs (bf16 weights), all through benchmarks/frontier.py.
#
#   bash benchmarks/gpu_frontier.sh OUT            # records land in OUT (a run cut short keeps what it finished)
#
# It stops itself before LIMIT_S seconds (default 540, for a 600 s device limit): frontier.py gets a
# deadline 30 s before it (it sizes training from a measured s/step, keeps EVAL_RESERVE_MIN minutes
# for the evaluations, stops a step still running at the deadline and skips what cannot start), and
# `timeout` kills it at LIMIT_S as a last resort. Settings (environment):
#   FRONTIER_MODEL  base model (default: the embedded smollm2-135m-instruct)
#   FRONTIER_DATA   folder with devset.csv and testset_w_refs.csv (default: ../shared/data/e2e)
#   DEVICE (cuda)  BF16 (1 on cuda: bf16 autocast in training, bf16 weights in evaluation)
#   EPOCHS (5)  BATCH (64)  EVAL_BATCH (128)  LIMIT_S (540)  EVAL_RESERVE_MIN (4)
#   RUNS (runs/gpu_frontier: models, not copied to OUT)  PYTHON (python)
#   FRONTIER_ARGS   extra frontier.py options, e.g. "--recipe no-prompt-grad --mixed 2,3,5 --limit 200"
# With DEVICE=cpu BF16=1 and a tiny model it runs on CPU (tests/test_frontier.py does, so a typo or a
# bf16 dtype error fails CI).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
OUT=${1:-${OUT:-gpu_out}}
LIMIT_S=${LIMIT_S:-540}
MODEL=${FRONTIER_MODEL:-smollm2-135m-instruct}
DATA=${FRONTIER_DATA:-../shared/data/e2e}
DEVICE=${DEVICE:-cuda}
EPOCHS=${EPOCHS:-5}
BATCH=${BATCH:-64}
EVAL_BATCH=${EVAL_BATCH:-128}
EVAL_RESERVE_MIN=${EVAL_RESERVE_MIN:-4}
RUNS=${RUNS:-runs/gpu_frontier}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{
  date -u
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
  nvidia-smi -L 2>/dev/null
} > "$OUT/env.txt" 2>&1
BF16=${BF16:-$([ "$DEVICE" = cuda ] && echo 1 || echo 0)}
GPU_ARGS=()
if [ "$BF16" = 1 ]; then GPU_ARGS=(--bf16 --eval-dtype bfloat16); fi
LEFT=$((LIMIT_S - ($(date +%s) - START)))
DEADLINE_MIN=$("$PY" -c "print(max(0.1, ($LEFT - 30) / 60))")
# shellcheck disable=SC2086  # FRONTIER_ARGS is a list of options
timeout --signal=TERM --kill-after=10 "$LEFT" "$PY" benchmarks/frontier.py --model "$MODEL" \
  --data "$DATA/devset.csv" --test-data "$DATA/testset_w_refs.csv" --device "$DEVICE" "${GPU_ARGS[@]}" \
  --epochs "$EPOCHS" --batch-size "$BATCH" --eval-batch-size "$EVAL_BATCH" --mixed "" \
  --deadline-minutes "$DEADLINE_MIN" --eval-reserve-minutes "$EVAL_RESERVE_MIN" \
  --out "$OUT" --name gpu_frontier --runs "$RUNS" --no-progress ${FRONTIER_ARGS:-} 2>&1 | tee "$OUT/log.txt"
RC=${PIPESTATUS[0]}
echo "gpu_frontier.sh: exit $RC after $(($(date +%s) - START)) s" | tee -a "$OUT/log.txt"
exit "$RC"
