"""tests/xla run in the torch-xla venv (`make test-xla`): torch 2.9 + torch-xla 2.9, as on Neuron 2.28."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
