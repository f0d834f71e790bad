"""The frozen trn1 path: torch-neuronx's XLA build (PJRT on NeuronCores) with neuronx-distributed, and xla-cpu.

AWS ended PyTorch/XLA training with Neuron 2.30 and NxD Training with 2.31; this path stays for trn1 on Neuron
<= 2.29 and gets fixes, not features. It sits behind the same seam as the living backends and has its own resume
protocol (``state.pt`` and NxD's shards, resumed through Ray Train's latest checkpoint: the backends' resume format
is :class:`~raytrn.xla.resume.RecordedResume`):

- :mod:`~raytrn.xla.backend`: the XLA loop hooks (``XlaBackend``) and ``xla-cpu``.
- :mod:`~raytrn.xla.neuron_xla`: ``neuron-xla`` (trn1) and its Ray Train backend config.
- :mod:`~raytrn.xla.nxd`: neuronx-distributed's layout checks, config, model, optimizer, sharded saves.
- :mod:`~raytrn.xla.checkpoints`: ``state.pt``, NxD and no-op (compile trial) checkpoints.
- :mod:`~raytrn.xla.resume`: how they resume (driver and workers), through Ray Train's recorded checkpoints.
- :mod:`~raytrn.xla.env`: a trn1 worker's PJRT/Neuron runtime environment.
- :mod:`~raytrn.xla.neuron_compile`: ``raytrn precompile`` (``neuron_parallel_compile``).

Only the backend registry (:func:`raytrn.backends.get_backend`, by module path) and the XLA branches of
``raytrn precheck`` / ``raytrn precompile`` reach it; nothing of the native path imports it, and deleting this
package leaves the rest importable.
"""
