"""Off-the-loop evaluation of committed checkpoints: a model raytrn exported in Hugging Face format (a local
directory with ``config.json``, the weights and the tokenizer) is scored with EleutherAI's ``lm-eval`` harness on
tasks raytrn ships, built on this machine from the Python standard library's source (the demo corpus), offline and
outside the training loop (:mod:`raytrn.evals.harness`).
"""
