#!/bin/bash
# The 16-worker cells of the regime tables (issue 40): 8 nodes x 2 ranks, real runs under the
# emulated link of regime R (uneven devices cannot be composed: their arrivals decide the mixing).
# Device time is 1000 ms a step, not the 2x2 tables' 500: 16 ranks of this model need about
# 0.55 s of both cores a step (forward, backward, gossip; DDP's gloo all-reduce 0.75 s), so at
# 500 ms the cores, not the emulated devices, would set the pace. Run alone.
# sixteen.sh R SEED HARDWARE... (even, half, jitter); METHODS overrides the methods.
set -eu
cd "$(dirname "$0")/../.."
r=$1; seed=$2; shift 2
methods=${METHODS:-"ddp decent:alternating-exp-ring+int8:x3:uneven diloco:H16:x1.5:olr0.5:om0.7:hetero"}
# shellcheck disable=SC2086
PYTHONPATH=$PWD exec python benchmarks/time_to_quality.py --shape 8x2 --regime "$r" --hardware "$@" \
  --workload shakespeare --steps 480 --warmup 48 --eval-every 24 --val-batches 8 \
  --max-steps-factor 1.5 --time-limit-factor 0 --device-ms 1000 --seed "$seed" --timeout 7200 \
  --snapshot-rounds 12 --out benchmarks/results --tag "r40u_{link}_{shape}_{hardware}_s{seed}" --methods $methods
