#!/usr/bin/env bash
# Time to quality of the outer-step modes on an even emulated cluster (issue 32): every step
# padded to DEVICE_MS of device time, the convergence study's 1200-step schedule, for each link
# rate, seed and cluster shape given.
#   benchmarks/outer_ttq.sh                                   # 2 nodes x 2, 3 rates, seed 0
#   SHAPE=4x1 RATES="1gbit 100mbit" SEEDS="0 1" benchmarks/outer_ttq.sh
# Methods (METHODS): DDP; DiLoCo at its best tuning in experiments/outer_sim (H 16, inner rate
# x1.5, outer 0.5/0.7); ours with plain local steps and with outer=LocalOuterSGD (every 32) at
# the documented 2x rate. Results: benchmarks/results/ttq_<rate>_outer_<shape>_s<seed>.*;
# tables: python benchmarks/outer_report.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
shape=${SHAPE:-2x2}
nodes=${shape%x*} nproc=${shape#*x}
steps=${STEPS:-1200}
ring=decent:alternating-exp-ring+int8:H4
methods=${METHODS:-"ddp diloco:H16:x1.5:olr0.5:om0.7 $ring:x2 $ring:slow32:x2"}
for rate in ${RATES:-1gbit 100mbit 20mbit}; do
  for seed in ${SEEDS:-0}; do
    TTQ_PLOT=0 TTQ_NODES=$nodes TTQ_NPROC=$nproc TTQ_SUFFIX="_outer_${shape}_s${seed}" \
    TTQ_ARGS="--steps $steps --warmup $((steps / 5)) --eval-every 24 --seed $seed \
      --max-steps-factor 1.5 --time-limit-factor 2.5 --device-ms ${DEVICE_MS:-80} --methods $methods" \
      benchmarks/time_to_quality.sh "$rate"
  done
done
