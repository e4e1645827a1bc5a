"""The optimizer classes and the engine they share; import the classes from :mod:`decent_optim`.

=============================================  ==============================================
module                                         what it does
=============================================  ==============================================
:mod:`~decent_optim.optim.engine`              the round machinery around an update rule
:mod:`~decent_optim.optim.startup`             process group, topology, buckets, equal starts
:mod:`~decent_optim.optim.agreement`           what the ranks must agree on; one error for all
:mod:`~decent_optim.optim.membership`          which optimizer owns a parameter; its channel
:mod:`~decent_optim.optim.rounds`              the round in flight and the round counter
:mod:`~decent_optim.optim.state`               ``opt.state`` in flat buffers; the batches
:mod:`~decent_optim.optim.watched`             dicts that report writes
:mod:`~decent_optim.optim.inputs`              the gradients a step reads, checked
:mod:`~decent_optim.optim.consensus`           the averaged model for evaluation and export
:mod:`~decent_optim.optim.checkpoint`          ``state_dict`` / ``load_state_dict``
:mod:`~decent_optim.optim.ownership`           whose state a checkpoint holds; another's refused
:mod:`~decent_optim.optim.frameworks`          a Lightning strategy that would run it wrong
:mod:`~decent_optim.optim.options`             the keyword arguments every class shares
``dsgd``, ``dadam``, ``accum_adam``            the public classes: hyper-parameters + a rule
=============================================  ==============================================
"""
