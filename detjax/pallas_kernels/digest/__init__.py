"""The fingerprint digests' lane sums of large tensors in one Pallas pass (kernel.py). Not a model kernel, and
off by default (detjax.fingerprint.DIGEST_KERNEL): where it is on, a one-device GPU run's digests use it for
large leaves, with the XLA reductions' bits (integer sums: any order, any blocking)."""
