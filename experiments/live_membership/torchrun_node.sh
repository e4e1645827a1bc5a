#!/bin/bash
# One emulated node of live membership under torchrun (docs/surviving_failures, "Under
# torchrun"): run by ../shared/tools/emulate-cluster on every node, it starts one torchrun job
# of 2 workers (tests/_torchrun_worker.py, a rendezvous of its own, --max-restarts 1); node 0
# also serves the package's store (a process that trains nothing) until node 1's job is done.
#
#   mkdir -p /tmp/live-emu && flock /tmp/emulate.lock ../shared/tools/emulate-cluster \
#       --nodes 2 --rate 1gbit -- experiments/live_membership/torchrun_node.sh /tmp/live-emu 100 3:40
#
# then: experiments/live_membership/torchrun_jobs.sh --summary /tmp/live-emu
set -u
OUT=$1; STEPS=$2; KILL=$3
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
if [ "$NODE_RANK" = 0 ]; then
  "$PYTHON" -m decent_optim.store --port 29750 --port-file "$OUT/port" > "$OUT/store.log" 2>&1 &
  STORE=$!
fi
while [ ! -e "$OUT/port" ]; do sleep 0.1; done
"$PYTHON" -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --max-restarts 1 \
  --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29760 \
  "$ROOT/tests/_torchrun_worker.py" "$MASTER_ADDR:29750" "$NNODES" "$STEPS" "$KILL" "$OUT" \
  > "$OUT/node$NODE_RANK.log" 2>&1
echo "$? $(date +%s.%N)" > "$OUT/node$NODE_RANK.rc"
if [ "$NODE_RANK" = 0 ]; then
  while [ ! -e "$OUT/node1.rc" ]; do sleep 0.1; done
  kill -TERM "$STORE"; wait "$STORE"
fi
