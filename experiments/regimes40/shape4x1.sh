#!/bin/bash
# The 4 nodes x 1 rank cells of the regime tables (issue 40), even devices, seed SEED: every rank
# a node of its own, so every exchange crosses an uplink. DDP and DiLoCo average exactly whatever
# the shape, so their quality runs are the 2x2 ones; ours mixes by topology, so its quality run is
# made here, without a link (LWS=1). Then the timing runs, alone, under each regime's link.
# shape4x1.sh SEED [quality|timing]... (default: both). At R = 30 the 8-step timing of ours is
# mostly its start: the docs' table times ours over 32 steps as well (r40t_{link}_4x1_long_s<seed>):
#   SHAPE=4x1 experiments/regimes40/timing.sh 30 32 SEED 'r40t_{link}_4x1_long_sSEED' <ours>
# Compose (R = 0.3, 3, 30; at 30 put r40t_R30_4x1_long_s<seed>+ first on the timing side):
#   python benchmarks/report.py --compose r40q_4x1_s<seed>+r40q5_2x2_s<seed>+r40q_2x2_s<seed> \
#     r40t_R<r>_4x1_short_s<seed>+r40t_R<r>_4x1_h4_s<seed>+r40t_R<r>_4x1_h16_s<seed>
set -eu
cd "$(dirname "$0")/../.."
here=experiments/regimes40
seed=$1; shift
what=${*:-quality timing}
ours="decent:alternating-exp-ring+int8:x3 decent:one-peer-exp+int8:x3"
if [[ $what == *quality* ]]; then
  # shellcheck disable=SC2086
  LWS=1 "$here/quality.sh" "$seed" "r40q_4x1_s$seed" ddp $ours \
    --ddp-from "benchmarks/results/ttq_r40q_2x2_s$seed.json"
fi
if [[ $what == *timing* ]]; then
  export SHAPE=4x1
  for r in 3 0.3 30; do
    uptime
    if [ "$r" = 30 ]; then k=8; k4=16; else k=16; k4=96; fi
    # shellcheck disable=SC2086
    "$here/timing.sh" "$r" "$k" "$seed" "r40t_{link}_4x1_short_s$seed" ddp $ours
    "$here/timing.sh" "$r" "$k4" "$seed" "r40t_{link}_4x1_h4_s$seed" diloco:H4:avg:x2
    "$here/timing.sh" "$r" 48 "$seed" "r40t_{link}_4x1_h16_s$seed" diloco:H16:x1.5:olr0.5:om0.7
  done
  uptime
fi
