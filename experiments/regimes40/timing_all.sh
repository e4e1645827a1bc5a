#!/bin/bash
# The timing runs of the first regime tables (2 nodes x 2, even devices, seed 0), one regime after
# the other, alone on the machine. K = 96: every method's first period (1, 4, 8, 16, 32) plus a
# multiple of it; sdiloco (period 32 + tau 2) takes 98. At R = 30 DDP takes 6 steps (its step is
# tens of seconds there) and every-step gossip is left out (a round needs many steps to cross).
set -u
here=$(dirname "$0")
ours="decent:alternating-exp-ring:x3 decent:alternating-exp-ring+int8:x3 decent:alternating-exp-ring+int8:H4:slow32:x2 decent:alternating-exp-ring+int8:H8:x2"
peers="diloco:H16:x1.5:olr0.5:om0.7 torchft-diloco:H32"
for r in ${REGIMES:-3 0.3 30}; do
  uptime
  if [ "$r" = 30 ]; then
    "$here/timing.sh" 30 6 0 "r40t_{link}_ddp_s0" ddp
    "$here/timing.sh" 30 96 0 "r40t_{link}_s0" ddp decent:alternating-exp-ring+int8:H4:slow32:x2 decent:alternating-exp-ring+int8:H8:x2 $peers
  else
    "$here/timing.sh" "$r" 96 0 "r40t_{link}_s0" ddp $ours $peers
  fi
  "$here/timing.sh" "$r" 98 0 "r40t_{link}_sd_s0" ddp sdiloco:H32:F4:tau2:alpha0.5:q4
done
uptime
