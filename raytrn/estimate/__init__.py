"""``raytrn estimate``: before renting a node, what a job needs and what it will cost.

- :mod:`raytrn.estimate.memory`: memory a worker by layout (state, FSDP's gathered blocks, activations, logits);
- :mod:`raytrn.estimate.devices`: a worker's device (its memory and peak, and their sources);
- :mod:`raytrn.estimate.failures`: interruptions and the Young/Daly checkpoint interval;
- :mod:`raytrn.estimate.reference`: the measured figures raytrn ships (MFU, restart time), each with its source;
- :mod:`raytrn.estimate.job`: all of it for one job, and the smallest changes that make it fit;
- :mod:`raytrn.estimate.cli`: the command.
"""
