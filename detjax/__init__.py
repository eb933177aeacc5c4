"""detjax: bitwise-deterministic pretraining in JAX/Flax.

Importing the package imports no JAX, so `python -m detjax.train` can set XLA flags first.
"""

__version__ = "0.1.0"
