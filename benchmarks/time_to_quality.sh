#!/usr/bin/env bash
# Time to quality on the emulated cluster: 2 nodes x 2 ranks (TTQ_NODES, TTQ_NPROC), one run per
# link rate, then the plot.
# Needs root (network namespaces); one benchmark at a time on the machine (flock).
#   benchmarks/time_to_quality.sh [RATE ...]          default: 1gbit 100mbit
# Options for time_to_quality.py go in $TTQ_ARGS, e.g. the reduced size of the docs:
#   TTQ_ARGS="--steps 480 --warmup 96 --eval-every 48" benchmarks/time_to_quality.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
emulate=${EMULATE_CLUSTER:-../shared/tools/emulate-cluster}
[[ -x $emulate ]] || emulate=../../shared/tools/emulate-cluster  # from a worktree under wt/
python=${PYTHON:-python}
rates=("$@")
((${#rates[@]})) || rates=(1gbit 100mbit)
for rate in "${rates[@]}"; do
  echo "== link rate $rate; load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  flock /tmp/emulate.lock "$emulate" --nodes "${TTQ_NODES:-2}" --rate "$rate" --timeout "${TTQ_TIMEOUT:-3600}" -- \
    bash -c "$python benchmarks/time_to_quality.py --nproc ${TTQ_NPROC:-2} --tag $rate${TTQ_SUFFIX:-} ${TTQ_ARGS:-}"
done
if [[ ${TTQ_PLOT:-1} == 1 ]]; then
  "$python" benchmarks/time_to_quality.py --plot "${rates[@]/%/${TTQ_SUFFIX:-}}"
fi
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
