"""Orbax checkpoints that restore every tracked bit: state, data iterator, RNG, fingerprints, config."""

from detjax.ckpt.manager import Checkpointer, CheckpointError, StopSignals

__all__ = ["CheckpointError", "Checkpointer", "StopSignals"]
