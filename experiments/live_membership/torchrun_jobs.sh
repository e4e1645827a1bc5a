#!/bin/bash
# Live membership under torchrun on one machine (docs/surviving_failures, "Under torchrun"):
# the package's store, AGENTS torchrun jobs of NPROC workers each (a rendezvous of their own,
# --max-restarts 1), running tests/_torchrun_worker.py; KILL is ID:STEP (SIGKILL at its first
# launch). Prints each final worker's steps, a newcomer's first step after its start and after
# the kill, its held-out loss, and each launcher's exit code and seconds after the end.
#
#   experiments/live_membership/torchrun_jobs.sh /tmp/live-tr 100 3:40 2 2   # 2 nodes x 2
#   experiments/live_membership/torchrun_jobs.sh /tmp/live-tr 100 3:40 4 1   # 4 agents x 1
#   experiments/live_membership/torchrun_jobs.sh --summary /tmp/live-emu     # torchrun_node.sh's
set -u
PYTHON=${PYTHON:-python}

summary() {
  (cd "$1" && "$PYTHON" - <<'PY'
import glob, json
records = [json.load(open(f)) for f in glob.glob("*.json")]
killed = float(open("killed").read()) if glob.glob("killed") else float("nan")
end = max(r["destroyed"] for r in records)
for r in sorted(records, key=lambda r: r["id"]):
    line = f"id {r['id']}: steps {r['first']}..{r['first'] + r['steps'] - 1}"
    if r["joined"]:
        line += (f", joined: first step {r['first_step'] - r['started']:.2f} s after its start, "
                 f"{r['first_step'] - killed:.2f} s after the kill")
    print(f"{line}; held-out loss {r['heldout']:.6f}")
for f in sorted(glob.glob("node*.rc")):
    code, at = open(f).read().split()
    print(f"{f[:-3]}: launcher exit code {code}, {float(at) - end:.2f} s after the end")
PY
  )
  grep -h "live membership, generation" "$1"/node*.log | sed 's/, this one.*//' | sort | uniq -c
}

if [ "$1" = --summary ]; then summary "$2"; exit; fi
OUT=$1; STEPS=$2; KILL=$3; AGENTS=$4; NPROC=$5
STORE_PORT=${STORE_PORT:-29730}; RDZV_PORT=${RDZV_PORT:-29740}   # RDZV_PORT + agent index
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$OUT"; mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
"$PYTHON" -m decent_optim.store --port "$STORE_PORT" --port-file "$OUT/port" > "$OUT/store.log" 2>&1 &
STORE=$!
while [ ! -e "$OUT/port" ]; do sleep 0.1; done
JOBS=""
for n in $(seq 0 $((AGENTS - 1))); do
  ( "$PYTHON" -m torch.distributed.run --nnodes 1 --nproc-per-node "$NPROC" --max-restarts 1 \
      --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$((RDZV_PORT + n))" \
      "$ROOT/tests/_torchrun_worker.py" "127.0.0.1:$STORE_PORT" "$AGENTS" "$STEPS" "$KILL" "$OUT" \
      > "$OUT/node$n.log" 2>&1
    echo "$? $(date +%s.%N)" > "$OUT/node$n.rc" ) &
  JOBS="$JOBS $!"
done
wait $JOBS
kill -TERM $STORE; wait $STORE
summary "$OUT"
