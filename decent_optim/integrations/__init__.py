"""Adapters for training frameworks; each module imports its framework, so import it by name.

* :mod:`decent_optim.integrations.hf`: :class:`~decent_optim.integrations.hf.DecentralizedTrainer`,
  a Hugging Face ``Trainer`` that keeps the model unwrapped (no DDP all-reduce), checkpoints
  every rank's model and optimizer, and evaluates and saves the consensus model
  (``pip install decent-optim[hf]``).
* :mod:`decent_optim.integrations.accelerate`:
  :class:`~decent_optim.integrations.accelerate.DecentralizedAccelerator`, an ``Accelerator``
  whose ``prepare`` does not wrap models in DDP and whose ``save_state``/``load_state`` keep
  each rank's own state (``pip install decent-optim[hf]``).
* :mod:`decent_optim.integrations.lightning`:
  :class:`~decent_optim.integrations.lightning.DecentralizedStrategy`, a Lightning strategy that
  launches like ``"ddp"`` without the DDP wrapper (``pip install decent-optim[lightning]``).
* :mod:`decent_optim.integrations.common`: what they share (torch only): finding a decentralized
  optimizer behind a framework's wrapper, and the per-rank checkpoint file.

:class:`decent_optim.gossip.GossipAverager` serves users of torch's ``PostLocalSGDOptimizer``; it
lives in the gossip layer because it is a ``ModelAverager`` of :mod:`torch.distributed`.

Importing this package imports no framework.
"""
