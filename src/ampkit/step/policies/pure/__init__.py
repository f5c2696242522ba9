"""The pure family: ``bf16-pure`` and ``fp16-pure`` ("O2"), half weights with fp32 masters, and
bf16-pure's memory ladder.

=============  ==============================================================================
file           what it holds
=============  ==============================================================================
policy.py      :class:`~.policy.PurePolicy`: the family's policy (prepare, forward, release)
masters.py     :class:`~.masters.MasterWeights`: fp32 masters in the user's optimizers
ladder.py      :class:`~.ladder.LadderWeights`: the ``split``/``kahan``/``stochastic`` rungs and
               bf16 states, stepped chunk by chunk through a bounded scratch
pieces.py      the chunk plan, a weight cut into pieces, the bf16 states' fp32 arena
sharded.py     :class:`~.sharded.ShardedStates`: bf16 optimizer states over FSDP2's fp32 shards
cast.py        :class:`~.cast.CastOnly`: ``masters='none'``, the bottom rung
rounding.py    the bit passes (native kernels first, else :mod:`.eager`) and stochastic rounding
eager.py       the eager torch bit passes and random bits: the kernels' bitwise reference
=============  ==============================================================================

The rung itself (what ``bf16-pure:split`` means) is a typed value in :mod:`ampkit.step.rung`.
This package's ``__init__`` imports nothing, so the native kernels
(:mod:`ampkit.step.policies.native`) can check themselves against :mod:`.eager` without a circle.
"""
