#!/bin/bash
# The quality half of the composed regime tables (issue 40): every method's whole schedule, no link,
# 4 ranks on this machine seen as 2 nodes x 2 (--local-world-size 2; LWS=1: as 4 nodes x 1),
# 500 ms of emulated device time per step (the timing runs' value: the composition refuses pairs
# that differ).
# quality.sh SEED TAG METHOD... (the first method must be ddp)
set -eu
cd "$(dirname "$0")/../.."
seed=$1; tag=$2; shift 2
PYTHONPATH=$PWD exec python benchmarks/time_to_quality.py --one-launch --nproc 4 --local-world-size "${LWS:-2}" \
  --workload shakespeare --steps 480 --warmup 48 --eval-every 24 --val-batches 8 \
  --max-steps-factor 1.5 --time-limit-factor 0 --device-ms 500 --seed "$seed" \
  --out benchmarks/results --tag "$tag" --methods "$@"
