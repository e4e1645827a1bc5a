#!/bin/bash
# The timing runs of the first regime tables (2 nodes x 2, even devices, seed 0), one regime after
# the other, alone on the machine. Methods of period 1 (DDP, gossip every step) take K = 16 (8 at
# R = 30, where their step is many seconds); the others K = 96: every one's first period (4, 8,
# 16, 32) plus a multiple of it; sdiloco (period 32 + tau 2) takes 98. Compose:
#   python benchmarks/report.py --compose r40q_2x2_s0+r40q2_2x2_s0+r40q3_2x2_s0 \
#     r40t_R<r>_short_s0+r40t_R<r>_s0+r40t_R<r>_sd_s0
set -u
here=$(dirname "$0")
short="ddp decent:alternating-exp-ring:x3 decent:alternating-exp-ring+int8:x3"
rest="diloco:H16:x1.5:olr0.5:om0.7 diloco:H8:x1.5:olr0.5:om0.7 diloco:H4:avg:x2 torchft-diloco:H32 decent:alternating-exp-ring+int8:H4:slow32:x2"
for r in ${REGIMES:-3 0.3 30}; do
  uptime
  if [ "$r" = 30 ]; then k=8; else k=16; fi
  "$here/timing.sh" "$r" "$k" 0 "r40t_{link}_short_s0" $short
  "$here/timing.sh" "$r" 96 0 "r40t_{link}_s0" $rest
  "$here/timing.sh" "$r" 98 0 "r40t_{link}_sd_s0" sdiloco:H32:F4:tau2:alpha0.5:q4
done
uptime
