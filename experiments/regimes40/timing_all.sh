#!/bin/bash
# The timing runs of the first regime tables (2 nodes x 2, even devices, seed 0), one regime after
# the other, alone on the machine. DDP (period 1) takes K = 16 (6 at R = 30, where its step is
# tens of seconds); the others K = 96: every one's first period (1, 4, 8, 16, 32) plus a multiple
# of it; sdiloco (period 32 + tau 2) takes 98. At R = 30 every-step gossip is left out (a round
# needs many steps to cross). Compose: report.py --compose r40q_2x2_s0+r40q2_2x2_s0 \
#   r40t_R<r>_ddp_s0+r40t_R<r>_s0+r40t_R<r>_sd_s0
set -u
here=$(dirname "$0")
every="decent:alternating-exp-ring:x3 decent:alternating-exp-ring+int8:x3"
rest="decent:alternating-exp-ring+int8:H4:slow32:x2 decent:alternating-exp-ring+int8:H8:x2 diloco:H16:x1.5:olr0.5:om0.7 torchft-diloco:H32"
for r in ${REGIMES:-3 0.3 30}; do
  uptime
  if [ "$r" = 30 ]; then k=6; them=$rest; else k=16; them="$every $rest"; fi
  "$here/timing.sh" "$r" "$k" 0 "r40t_{link}_ddp_s0" ddp
  "$here/timing.sh" "$r" 96 0 "r40t_{link}_s0" $them
  "$here/timing.sh" "$r" 98 0 "r40t_{link}_sd_s0" sdiloco:H32:F4:tau2:alpha0.5:q4
done
uptime
