"""Live recovery (issue 48): replicas that keep training when one is lost, and newcomers that join a running group.

:mod:`.group` re-forms torch.distributed's default process group among the live members over a shared c10d store;
:mod:`.step` splits each step's global batch over whoever is alive and redoes a step a loss interrupted;
:mod:`.transfer` copies a live replica's state to newcomers. No Ray here: the Ray loop drives these.
"""
