#!/bin/bash
# The timing half of the composed regime tables (issue 40): K steps of each method under the
# emulated link of regime R (2 nodes x 2 ranks, or SHAPE, e.g. 4x1; 500 ms of device time per
# step), no evaluation.
# Run alone (nothing else on the machine): timing.sh R K SEED TAG METHOD... (first: ddp)
set -eu
cd "$(dirname "$0")/../.."
r=$1; k=$2; seed=$3; tag=$4; shift 4
PYTHONPATH=$PWD exec python benchmarks/time_to_quality.py --regime "$r" --shape "${SHAPE:-2x2}" \
  --workload shakespeare --steps 480 --warmup 48 --eval-every 24 --val-batches 8 \
  --max-steps-factor 1.5 --device-ms 500 --seeds "$seed" --timing-steps "$k" \
  --out benchmarks/results --tag "$tag" --methods "$@"
