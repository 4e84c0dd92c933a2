#!/usr/bin/env bash
# The project's real runs in one script, for a machine with one CUDA GPU (prepared, not run yet):
# fine-tune SmolLM2-135M-Instruct on E2E dev at 1x, 2x, 3x, 5x and mixed 2/3/5x (full fine-tuning)
# plus a 2x LoRA run, evaluate all of them on the 630 E2E test MRs (with the sanity rows and a
# CALM-style early-exit row), CNN/DailyMail with the stock and the 2x model, and time decoding.
#
#   bash benchmarks/gpu_suite.sh MODEL DATA_DIR OUT_DIR
#
# MODEL: the embedded default name or a .gguf/checkpoint path; DATA_DIR holds devset.csv,
# testset_w_refs.csv and cnndm_specbench80.jsonl. Every step's results land in OUT_DIR as soon as
# it ends, so a run cut short still returns what it finished. The training commands are the
# README's CPU ones with more steps, a larger batch and --device cuda.
set -uo pipefail
MODEL=${1:-smollm2-135m-instruct}
DATA=${2:-../shared/data}
OUT=${3:-gpu_out}
STEPS=${STEPS:-200}
mkdir -p "$OUT" runs
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
TR="python benchmarks/train_e2e.py --model $MODEL --data $DATA/devset.csv --max-steps $STEPS --batch-size 32 --device cuda --no-progress --eval-every 50 --checkpoint-every 0"
log() { echo "[$(date +%H:%M:%S)] $*"; }
pack() { tar czf "$OUT/results.tgz" benchmarks/results 2>/dev/null; }

# Base checkpoint once (GGUF dequantized, plain model) so later loads take a second.
python - "$MODEL" <<'EOF'
import sys, skipdecode
m = skipdecode.load(sys.argv[1])
m.save_pretrained("runs/base")
print("base saved", m)
EOF
BASE=runs/base

for s in 2 3 5 1; do
  log "train ${s}x"; $TR --model $BASE --speedup $s --out runs/e2e-${s}x 2>&1 | tail -n 3; pack
done
log "eval E2E (630 MRs)"
python benchmarks/eval_e2e.py --ckpt 1x=runs/e2e-1x/final --ckpt 2x=runs/e2e-2x/final --ckpt 3x=runs/e2e-3x/final \
  --ckpt 5x=runs/e2e-5x/final --stock $BASE --batch-size 64 --device cuda --no-progress 2>&1 | tail -n 25; pack
log "train LoRA 2x"
$TR --model $BASE --speedup 2 --lora-r 16 --lr 1e-3 --out runs/e2e-2x-lora16 2>&1 | tail -n 3; pack
log "train mixed 2,3,5"
$TR --model $BASE --speedup 2,3,5 --out runs/e2e-mix 2>&1 | tail -n 3; pack
log "eval mixed + LoRA"
python -m skipdecode.cli eval --model runs/e2e-mix/final --speedup 2 --speedup 3 --speedup 5 --batch-size 64 \
  --device cuda --out benchmarks/results --name eval_e2e_mix --no-progress 2>&1 | tail -n 8; pack
python -m skipdecode.cli eval --model runs/e2e-2x-lora16/final --policy checkpoint --batch-size 64 \
  --device cuda --out benchmarks/results --name eval_e2e_lora --no-progress 2>&1 | tail -n 8; pack
log "CALM-style early exit (batch 1, first 150 MRs)"
python benchmarks/eval_e2e.py --ckpt 1x=runs/e2e-1x/final --no-stock --calm-threshold 0.9 --limit 150 \
  --batch-size 1 --device cuda --name eval_e2e_calm --no-progress 2>&1 | tail -n 8; pack
log "CNN/DM (80 articles), stock and 2x"
python benchmarks/eval_e2e.py --task cnndm --ckpt 2x=runs/e2e-2x/final --stock $BASE --batch-size 16 \
  --device cuda --no-progress 2>&1 | tail -n 8; pack
log "decode speed on the GPU"
python benchmarks/decode_speed.py --model $BASE --device cuda --batch-sizes 1,8,32 --out benchmarks/results/decode_speed_h200.json 2>&1 | tail -n 20; pack
cp -r runs/e2e-2x-lora16/final "$OUT/lora2x" 2>/dev/null
log "done"
