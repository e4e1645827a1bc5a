#!/bin/bash
# Many runs of the study at once on a machine with more cores: seeds.sh QUEUE [PARALLEL]
# QUEUE has one run a line, "SEED METHOD LR" (METHOD: ddp, or a topology for DecentralizedAdamW
# every step, e.g. ring or complete); PARALLEL runs of 4 ranks at a time (default 4: 16 cores).
# env: NANOGPT (the ported checkout), LOGS (default ./logs), ITERS (run.sh's; names end -i<ITERS>).
# One summary line a run on stdout.
set -u
here=$(cd "$(dirname "$0")" && pwd)
export here
queue=$1; parallel=${2:-4}
one() {
  set -- $1
  local end=${ITERS:+-i$ITERS}
  if [ "$2" = ddp ]; then SEED=$1 OPT=ddp "$here/run.sh" "s$1-ddp-$3$end" "$3"
  else SEED=$1 OPT=decent TOPO=$2 H=1 "$here/run.sh" "s$1-${2}1-$3$end" "$3"; fi
}
export -f one
xargs -P "$parallel" -I{} bash -c 'one "{}"' < "$queue"
