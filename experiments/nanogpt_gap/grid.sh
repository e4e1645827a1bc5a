#!/bin/bash
# The study's runs (about 1.5-2 minutes each on 2 cores): the learning-rate grids of DDP and of
# DecentralizedAdamW on the ring for two seeds, then the probes of the causes.
run=$(dirname "$0")/run.sh
for s in 1337 2337; do
  for lr in 1.6e-2 2e-2 2.4e-2; do
    SEED=$s OPT=ddp $run s$s-ddp-$lr $lr
    SEED=$s OPT=decent TOPO=ring H=1 $run s$s-ring1-$lr $lr
  done
done
for lr in 1e-3 2e-3 4e-3 6e-3 8e-3 1.2e-2 3.2e-2 4.8e-2; do OPT=ddp $run s1337-ddp-$lr $lr; done
for lr in 2e-3 3e-3 4e-3 6e-3 8e-3 1.2e-2 3.2e-2; do OPT=decent TOPO=ring H=1 $run s1337-ring1-$lr $lr; done
for lr in 1.2e-2 2.4e-2; do OPT=decent TOPO=complete H=1 $run s1337-complete1-$lr $lr; done
for s in 1337 2337; do for lr in 2e-2 2.4e-2; do
  SEED=$s OPT=decent TOPO=one-peer-exp H=1 $run s$s-ope1-$lr $lr
done; done
for lr in 1.2e-2 1.6e-2 2.4e-2; do OPT=decent TOPO=ring H=2 $run s1337-ring2-$lr $lr; done
for lr in 8e-3 1.2e-2 2.4e-2; do OPT=decent TOPO=ring H=4 $run s1337-ring4-$lr $lr; done
for lr in 6e-3 1.2e-2; do OPT=decent TOPO=ring ACC=4 $run s1337-ringacc4-$lr $lr; done
for lr in 1.6e-2 2e-2 2.4e-2; do OPT=decent TOPO=ring H=1 $run s1337-ring1-$lr-clip2 $lr --grad_clip=2.0; done
OPT=decent TOPO=ring H=1 $run s1337-ring1-1.2e-2-clip0 1.2e-2 --grad_clip=0.0
OPT=ddp $run s1337-ddp-1.2e-2-clip0 1.2e-2 --grad_clip=0.0
