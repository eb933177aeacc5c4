"""Multi-process (multi-controller) start-up: `jax.distributed.initialize` from config, CLI or SLURM."""

from __future__ import annotations

import os

from detjax.config import DistConfig


def initialize(dist: DistConfig) -> None:
    """Join the process group before any JAX backend starts. One process and no SLURM job: nothing to do.

    With `dist.coordinator` set, the address, process count and id come from config (or `key=value` on the
    command line); inside a SLURM allocation with several tasks, JAX reads them from the SLURM environment.
    """
    import jax

    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1
    if dist.num_processes <= 1 and not slurm:
        return
    if jax.distributed.is_initialized():
        return
    if dist.cpu_collectives != "none":
        # CPU devices of several processes exchange data through gloo (or MPI); without it a CPU
        # multi-process run cannot run collectives at all.
        jax.config.update("jax_cpu_collectives_implementation", dist.cpu_collectives)
    if dist.coordinator:
        jax.distributed.initialize(
            coordinator_address=dist.coordinator, num_processes=dist.num_processes, process_id=dist.process_id
        )
    else:
        jax.distributed.initialize()
    if jax.default_backend() == "cpu":
        # A CPU executable read back from the persistent compilation cache (JAX_COMPILATION_CACHE_DIR) does not
        # join the other processes' collectives: two processes of four CPU devices hung on their first step
        # once the cache was warm (tests/test_mesh.py's two-process test). CPU multi-process runs compile afresh.
        jax.config.update("jax_enable_compilation_cache", False)


def is_primary() -> bool:
    """Process 0 writes the run files; the others only take part in computation and checkpoints."""
    import jax

    return jax.process_index() == 0
