"""The fingerprint digests' lane sums of large tensors in one Pallas pass (kernel.py). Not a model kernel: the
trainer's fingerprints use it on a one-device GPU run, and detjax.fingerprint's XLA reductions everywhere else,
with the same bits (integer sums: any order, any blocking)."""
