"""The optimizer classes and the engine they share; import the classes from :mod:`decent_optim`.

=============================================  ==============================================
module                                         what it does
=============================================  ==============================================
``dsgd``, ``dadam``, ``accum_adam``            the public classes: hyper-parameters + a rule
:mod:`~decent_optim.optim.engine`              the round machinery around an update rule
:mod:`~decent_optim.optim.options`             the keyword arguments every class shares
:mod:`~decent_optim.optim.startup`             process group, topology, buckets, equal starts
:mod:`~decent_optim.optim.agreement`           what the ranks must agree on; one error for all
:mod:`~decent_optim.optim.param_owner`         which optimizer owns a parameter; its channel
:mod:`~decent_optim.optim.frameworks`          a Lightning strategy that would run it wrong
:mod:`~decent_optim.optim.stepping`            the eager parts of a step, around the rule
:mod:`~decent_optim.optim.inputs`              the gradients a step reads, checked
:mod:`~decent_optim.optim.state`               ``opt.state`` in flat buffers; the batches
:mod:`~decent_optim.optim.watched`             dicts that report writes
:mod:`~decent_optim.optim.failure`             a gossip failure latched: later calls raise it
:mod:`~decent_optim.optim.facts`               rank, world size, membership, bytes sent;
                                               progress, ``stop_at``, ``stopped``, ``round``
:mod:`~decent_optim.optim.consensus`           the averaged model for evaluation and export
*the schedule of rounds*
:mod:`~decent_optim.optim.schedules`           the keywords checked; the parts chosen
:mod:`~decent_optim.optim.rounds`              the one timeline: the round in flight, the counter
:mod:`~decent_optim.optim.local_steps`         when, step-locked: every step, every ``H`` steps
:mod:`~decent_optim.optim.doubling`            a cadence: periods that double after a warm-up
:mod:`~decent_optim.optim.uneven`              when, uneven periods: mixed once arrived
:mod:`~decent_optim.optim.uneven_periods`      their clock: progress, budget, periods; the loop
:mod:`~decent_optim.optim.poll`                how long: a round waited for in a thread, a cap
:mod:`~decent_optim.optim.travel`              what travels: the parameters, or the anchors
:mod:`~decent_optim.optim.outer`               the period end: nothing, DiLoCo, slow weights
*live membership*
:mod:`~decent_optim.optim.live`                a lost worker, a newcomer: every schedule
:mod:`~decent_optim.optim.joining`             a newcomer takes a member's state
*checkpoints*
:mod:`~decent_optim.optim.state_dicts`         ``state_dict`` / ``load_state_dict``
:mod:`~decent_optim.optim.checkpoint`          the package's entry: save, check, load
:mod:`~decent_optim.optim.local_checkpoint`    the anchors, outer momentum, slow weights
:mod:`~decent_optim.optim.ownership`           whose state a checkpoint holds; another's refused
=============================================  ==============================================
"""
