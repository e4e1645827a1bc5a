#!/usr/bin/env bash
# Time to quality on emulated uneven devices (issue 31): every step padded to DEVICE_MS of device
# time; "even", "half" (the last rank at half speed), "quarter" (at a quarter) and "jitter" (each step's time drawn with a
# 30% coefficient of variation), for each link rate, seed and cluster shape given.
#   benchmarks/uneven_ttq.sh                      # 2 nodes x 2, 100mbit, seed 0, even half jitter
#   SHAPE=4x1 RATES="1gbit 100mbit" SEEDS="0 1" HARDWARE="even half" benchmarks/uneven_ttq.sh
# Results: benchmarks/results/ttq_<rate>_uneven<TAG>_<shape>_<hardware>_s<seed>.{md,csv,json}
# (TAG: empty by default; another for another set of methods, e.g. TAG=-h2). UNEVEN_BUDGET: the
# uneven methods' budget in DDP-equivalent steps x STEPS (default 1.5; they train to it). TTQ_EXTRA:
# more options for time_to_quality.py (e.g. --global-batch 128). TTQ_DDP_FROM=<results .json>: take
# DDP's row (the target) from an earlier run instead of running DDP again (its table says so).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
shape=${SHAPE:-2x2}
nodes=${shape%x*} nproc=${shape#*x}
world=$((nodes * nproc))
device_ms=${DEVICE_MS:-80}
steps=${STEPS:-600}
methods=${METHODS:-"ddp diloco:H16 decent:alternating-exp-ring+int8:H4 decent:alternating-exp-ring+int8:H2:uneven"}
half=$(python3 -c "print(','.join(['1'] * ($world - 1) + ['0.5']))")
quarter=$(python3 -c "print(','.join(['1'] * ($world - 1) + ['0.25']))")
for rate in ${RATES:-100mbit}; do
  for seed in ${SEEDS:-0}; do
    for hardware in ${HARDWARE:-even half jitter}; do
      case $hardware in
        even) devices="--device-ms $device_ms" ;;
        half) devices="--device-ms $device_ms --speeds $half" ;;
        quarter) devices="--device-ms $device_ms --speeds $quarter" ;;
        jitter) devices="--device-ms $device_ms --jitter-cv 0.3" ;;
        *) echo "unknown hardware $hardware" >&2; exit 2 ;;
      esac
      TTQ_PLOT=0 TTQ_NODES=$nodes TTQ_NPROC=$nproc TTQ_SUFFIX="_uneven${TAG:-}_${shape}_${hardware}_s${seed}" \
      TTQ_ARGS="--steps $steps --warmup $((steps / 5)) --eval-every $((steps / 25)) --seed $seed \
        --max-steps-factor 1.5 --uneven-budget-factor ${UNEVEN_BUDGET:-1.5} --time-limit-factor 2.5 $devices ${TTQ_EXTRA:-} --methods $methods" \
        benchmarks/time_to_quality.sh "$rate"
    done
  done
done
