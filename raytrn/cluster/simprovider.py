"""The local simulator's node provider (``raytrn cluster up --local``): Ray's ``fake_multinode`` provider whose
nodes each unpack a job's ``working_dir`` into a directory of their own (see
:func:`raytrn.compat.simulator_node_provider`). The simulator's autoscaler loads it by this module path
(``provider.type: external``); nothing else imports it."""

from raytrn.compat import simulator_node_provider

SimulatorNodeProvider = simulator_node_provider()
