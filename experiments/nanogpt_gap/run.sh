#!/bin/bash
# One nanoGPT run of the study: run.sh NAME LR [train.py args...]
# env: NANOGPT (the ported checkout), LOGS (default ./logs), ITERS (the schedule's length, default
# 600: iterations and cosine decay; warm-up stays 60, as nanoGPT keeps its own fixed), and the
# port's OPT, TOPO, H, ACC, COMP, SEED
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs=${LOGS:-$here/logs}; mkdir -p "$logs"
name=$1; lr=$2; shift 2
cd "$NANOGPT"
export PYTHONPATH=${PYTHONPATH:-$here/../..} OMP_NUM_THREADS=1
start=$(date +%s)
torchrun --standalone --nproc-per-node 4 train.py --dataset=shakespeare_char --out_dir="/tmp/ngap-$name" \
  --device=cpu --compile=False --dtype=float32 --backend=gloo \
  --n_layer=4 --n_head=4 --n_embd=92 --block_size=64 --batch_size=12 \
  --gradient_accumulation_steps=4 --dropout=0.0 --always_save_checkpoint=False \
  --max_iters="${ITERS:-600}" --lr_decay_iters="${ITERS:-600}" --warmup_iters=60 --learning_rate="$lr" \
  --min_lr="$(python -c "print($lr / 10)")" --beta2=0.99 --eval_interval=100 --eval_iters=20 \
  --log_interval=100 "$@" > "$logs/$name.log" 2>&1
rc=$?
echo "$name rc=$rc $(( $(date +%s) - start )) s $(grep final: "$logs/$name.log") load $(cut -d' ' -f1-3 /proc/loadavg)"
exit $rc
