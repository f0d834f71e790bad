"""A run's checkpoints, in one package: where they are, how they are written, committed, found and restored.

- :mod:`~raytrn.checkpoint.rundir`: :class:`RunDir`, every path of a run's directory.
- :mod:`~raytrn.checkpoint.progress`: the counters and ``meta.json`` (no torch: the driver reads these).
- :mod:`~raytrn.checkpoint.manifest`: commit manifests, their checks, retention and staging.
- :mod:`~raytrn.checkpoint.finder`: the one rule for the checkpoint a run resumes from (driver and workers).
- :mod:`~raytrn.checkpoint.store`: the :class:`Checkpoints` interface the training loop saves and loads through.
- :mod:`~raytrn.checkpoint.sharded` and :mod:`~raytrn.checkpoint.dcp`: sharded, reshardable DCP checkpoints.
- :mod:`~raytrn.checkpoint.statefile`: the single-file ``state.pt`` format.
- :mod:`~raytrn.checkpoint.agree`: the small collectives the workers agree through.

Nothing here imports :mod:`raytrn.train` or :mod:`raytrn.backends`.
"""
