#!/bin/bash
# The uneven cells of the 2 nodes x 2 regime table (issue 40) at regime R, seed SEED: one worker at
# half speed, or every step jittered (CV 0.3). Run alone.
#  * DDP and DiLoCo are step-locked (their losses at step k do not depend on the devices), so
#    their time is composed: the even quality run's steps x seconds per step timed here on the
#    uneven devices (report.py --compose <the even quality runs>
#    r40t_R<r>_<hw>_short_s<seed>+r40t_R<r>_<hw>_s<seed>+r40t_R<r>_<hw>_h4_s<seed>).
#  * Ours with uneven=True is not (arrivals decide the mixing): a full run under the link; with one
#    worker at half speed also torchft's answer, a sync period per replica that follows its speed
#    (DiLoCo :hetero), a full run too. (With jitter every replica has the same speed.)
# uneven2x2.sh R SEED HARDWARE... (half, jitter)
set -eu
cd "$(dirname "$0")/../.."
r=$1; seed=$2; shift 2
common=(--workload shakespeare --steps 480 --warmup 48 --eval-every 24 --val-batches 8
        --max-steps-factor 1.5 --device-ms 500 --seeds "$seed" --out benchmarks/results)
# one run of the runner on this regime and hardware, with the schedule above
ttq() {
  PYTHONPATH=$PWD python benchmarks/time_to_quality.py --regime "$r" --shape 2x2 --hardware "$hw" \
    "${common[@]}" "$@"
}
for hw in "$@"; do
  uptime
  ttq --timing-steps 32 --tag "r40t_{link}_${hw}_short_s{seed}" --methods ddp
  ttq --timing-steps 96 --tag "r40t_{link}_${hw}_s{seed}" --methods diloco:H16:x1.5:olr0.5:om0.7
  ttq --timing-steps 96 --tag "r40t_{link}_${hw}_h4_s{seed}" --methods diloco:H4:avg:x2
  full="decent:alternating-exp-ring+int8:x3:uneven"
  [ "$hw" = half ] && full="$full diloco:H16:x1.5:olr0.5:om0.7:hetero"
  # shellcheck disable=SC2086
  ttq --time-limit-factor 0 --snapshot-rounds 12 --tag "r40u_{link}_{shape}_{hardware}_s{seed}" \
    --ddp-from "benchmarks/results/ttq_r40q_2x2_s${seed}.json" --methods ddp $full
done
uptime
