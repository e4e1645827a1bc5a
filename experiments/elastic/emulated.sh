#!/usr/bin/env bash
# The scenario of scenario.py on the emulated cluster: 2 nodes x 2 ranks, each node in its own
# network namespace (shaped link), node 0 hosting the c10d rendezvous. Node 1 runs the
# controller: it kills its own agent's process tree at the kill step and starts it again later.
#   flock /tmp/emulate.lock experiments/elastic/emulated.sh /tmp/elastic-emu [extra scenario args]
set -euo pipefail
workdir=${1:?usage: emulated.sh WORKDIR [scenario args]}
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
rm -rf "$workdir" && mkdir -p "$workdir"
export EMU_LOG_DIR=$workdir
/work/shared/tools/emulate-cluster --nodes 2 --rate 1gbit --timeout 900 -- bash -c '
  role=node$NODE_RANK
  exec python "$0" --role "$role" --workdir "$1" "${@:2}"
' "$here/scenario.py" "$workdir" "$@"
