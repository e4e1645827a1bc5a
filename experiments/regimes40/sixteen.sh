#!/bin/bash
# The 16-worker cells of the regime tables (issue 40): 8 nodes x 2 ranks under the emulated link of
# regime R. Device time is 1000 ms a step, not the 2x2 tables' 500: 16 ranks of this model need
# about 0.55 s of both cores a step (forward, backward, gossip), so at 500 ms the cores, not the
# emulated devices, would set the pace. Run alone.
#  * DDP, DiLoCo and ours without uneven are step-locked: a timing run each on every HARDWARE;
#    their steps to a loss come from the quality runs (experiments: r40q*_8x2_s<seed>, at 500 ms,
#    which does not change the steps), so their time is steps x seconds per step timed here.
#    DDP_STEPS (default 32) and DILOCO_STEPS (96) set how many steps are timed; at R = 30 DDP's
#    step is about a minute, so DDP_STEPS=8 times it on its own (tag ..._ddp_s<seed>).
#  * Ours with uneven=True (arrivals decide the mixing), on half and jitter: a short full run
#    (a 64-step schedule, a budget of 96 steps: 97-99 taken) for its seconds per step.
#  * HARDWARE half-long or jitter-long: only the full run of ours with uneven=True to DDP's loss
#    (a budget of 4.5x DDP's steps, snapshots evaluated every 96 steps or so; at R = 3 on half
#    speed 2162 steps, 52 minutes with the evaluation of its snapshots).
# sixteen.sh R SEED HARDWARE... (even, half, jitter, half-long, jitter-long)
set -eu
cd "$(dirname "$0")/../.."
r=$1; seed=$2; shift 2
common=(--shape 8x2 --regime "$r" --workload shakespeare --steps 480 --warmup 48
        --val-batches 8 --device-ms 1000 --seeds "$seed" --out benchmarks/results)
ours="decent:alternating-exp-ring+int8:x3"
sched=(--eval-every 24 --max-steps-factor 1.5 --timeout 3600)  # of the timing and short runs
ddp_from="benchmarks/results/ttq_r40q_8x2_s${seed}.json"
# one run of the runner on this regime and hardware, with the schedule above
ttq() {
  PYTHONPATH=$PWD python benchmarks/time_to_quality.py --hardware "$hw" "${common[@]}" "$@"
}
for hw in "$@"; do
  uptime
  if [ "${hw%-long}" != "$hw" ]; then
    hw=${hw%-long}
    ttq --eval-every 96 --timeout 5400 --time-limit-factor 0 --snapshot-rounds 24 \
      --uneven-budget-factor 4.5 --tag "r40u_{link}_{shape}_{hardware}_long_s{seed}" \
      --ddp-from "$ddp_from" --methods ddp "$ours:uneven"
    continue
  fi
  if [ "${DDP_STEPS:-32}" = 32 ]; then
    ttq "${sched[@]}" --timing-steps 32 --tag "r40t_{link}_8x2_${hw}_short_s{seed}" --methods ddp "$ours"
  else
    ttq "${sched[@]}" --timing-steps "$DDP_STEPS" --tag "r40t_{link}_8x2_${hw}_ddp_s{seed}" --methods ddp
    ttq "${sched[@]}" --timing-steps 32 --tag "r40t_{link}_8x2_${hw}_short_s{seed}" --methods "$ours"
  fi
  ttq "${sched[@]}" --timing-steps "${DILOCO_STEPS:-96}" --tag "r40t_{link}_8x2_${hw}_s{seed}" \
    --methods diloco:H16:x1.5:olr0.5:om0.7
  [ "$hw" = even ] && continue
  ttq "${sched[@]}" --steps 64 --warmup 8 --eval-every 32 --val-batches 2 --time-limit-factor 0 \
    --snapshot-rounds 12 --tag "r40u_{link}_{shape}_{hardware}_short_s{seed}" \
    --ddp-from "$ddp_from" --methods ddp "$ours:uneven"
done
uptime
