#!/usr/bin/env bash
# Benchmark (c): the training comparison on an emulated 2-node cluster (2 ranks per node), for
# several rates of the link between the nodes; then the plots. Needs root (network namespaces).
#   benchmarks/sweep_link.sh [RATE ...]        default: 100mbit 1gbit 10gbit
# Extra options for train_iteration.py can be given in $TRAIN_ARGS (e.g. "--iters 10").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
emulate=${EMULATE_CLUSTER:-../shared/tools/emulate-cluster}
python=${PYTHON:-python}
rates=("$@")
((${#rates[@]})) || rates=(100mbit 1gbit 10gbit)
for rate in "${rates[@]}"; do
  echo "== link rate $rate"
  "$emulate" --rate "$rate" --timeout 1500 -- \
    bash -c "$python benchmarks/train_iteration.py --nproc 2 --tag link_$rate ${TRAIN_ARGS:-}"
done
"$python" benchmarks/plot.py
