#!/usr/bin/env bash
# Time to quality on the emulated cluster: 2 nodes x 2 ranks (TTQ_NODES, TTQ_NPROC), one run per
# link rate, then the plot.
# Needs root (network namespaces); one benchmark at a time on the machine (flock).
#   benchmarks/time_to_quality.sh [RATE ...]          default: 1gbit 100mbit
# Options for time_to_quality.py go in $TTQ_ARGS, e.g. the reduced size of the docs:
#   TTQ_ARGS="--steps 480 --warmup 96 --eval-every 48" benchmarks/time_to_quality.sh
# Regimes instead of rates (issue 40): REGIMES="0.3 3 30" sets each run's link so that one fp32
# copy of the model takes R device steps to cross a node's uplink (needs --device-ms in TTQ_ARGS);
# the tags are R<r>:
#   REGIMES="0.3 3 30" TTQ_ARGS="--workload shakespeare --device-ms 100" benchmarks/time_to_quality.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
emulate=${EMULATE_CLUSTER:-../shared/tools/emulate-cluster}
[[ -x $emulate ]] || emulate=../../shared/tools/emulate-cluster  # from a worktree under wt/
python=${PYTHON:-python}
run() {  # rate tag [more options]
  echo "== link rate $1 ($2); load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  flock /tmp/emulate.lock "$emulate" --nodes "${TTQ_NODES:-2}" --rate "$1" --timeout "${TTQ_TIMEOUT:-3600}" -- \
    bash -c "$python benchmarks/time_to_quality.py --nproc ${TTQ_NPROC:-2} --tag $2${TTQ_SUFFIX:-} ${3:-} ${TTQ_ARGS:-}"
}
tags=()
if [[ -n ${REGIMES:-} ]]; then
  for r in $REGIMES; do
    # shellcheck disable=SC2086
    rate=$("$python" benchmarks/time_to_quality.py --print-rate --regime "$r" ${TTQ_ARGS:-})
    run "$rate" "R$r" "--regime $r"
    tags+=("R$r")
  done
else
  rates=("$@")
  ((${#rates[@]})) || rates=(1gbit 100mbit)
  for rate in "${rates[@]}"; do
    run "$rate" "$rate"
    tags+=("$rate")
  done
fi
if [[ ${TTQ_PLOT:-1} == 1 ]]; then
  "$python" benchmarks/time_to_quality.py --plot "${tags[@]/%/${TTQ_SUFFIX:-}}"
fi
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
