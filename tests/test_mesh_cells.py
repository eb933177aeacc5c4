"""Tensor, expert, FSDP and data-parallel cells on 8 CPU devices (pipeline cells: test_mesh_pipeline.py)."""

import pytest
from _cells import CELLS, Reference, check_cell

DENSE = [c for c, m in CELLS.items() if m.get("pipeline", 1) == 1]
HEAVY = {"tp2-ep4", "fsdp8-ep4"}
# Every cell is covered in kind in the default run: by the dp2-tp2-pp2 cell of test_mesh.py's two-process test
# (data, tensor and pipeline parallelism end to end against one process of 8 devices), by test_canonical.py's
# fsdp 2 x data 2 and expert 4 x data 2 steps against one device, by
# test_tensor_parallel_step_gathers_no_vocab_and_no_float_tensors below (the tp4 step compiled) and by
# test_mesh.py's golden shardings (every cell, sequence parallel included). The cells themselves (fsdp8-ep4
# about 90 s on 2 cores) run with `pytest -m extended` or scripts/mesh_sweep.py.
EXTENDED = {"dp8", "tp4", "tp8", "fsdp8", "ep2", "tp2-ep4", "tp4-sp", "tp2-ep2", "fsdp8-ep4"}


def _mark(c: str):
    marks = [pytest.mark.slow] if c in HEAVY else []
    return pytest.param(c, marks=[*marks, pytest.mark.extended] if c in EXTENDED else marks)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Reference(tmp_path_factory.mktemp("ref"))


@pytest.mark.parametrize("cell", [_mark(c) for c in DENSE])
def test_cell_repeats_bitwise_and_tracks_single_device(cell, tmp_path, reference):
    check_cell(cell, tmp_path, reference)


def test_tensor_parallel_step_gathers_no_vocab_and_no_float_tensors():
    """tp4: logits, embedding and LM head stay split over vocab (no full-vocab gather), and the per-step
    fingerprints digest each shard where it lies (integer partial sums) instead of gathering tensors."""
    import re

    import jax
    import jax.numpy as jnp
    from _cells import cell_overrides, cfg_for

    from detjax.sharding.mesh import build_layout
    from detjax.step import Trainer, compile_train_step

    cfg = cfg_for(*cell_overrides("tp4"))
    tr = Trainer(cfg, layout=build_layout(cfg, jax.devices()[:8]))
    ss, bs = tr.state_shardings(), tr.batch_sharding()
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len + 1), jnp.int32, sharding=bs)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tr.abstract_state(), ss)
    # The step the training loop runs (compile_train_step: reused if the tp4 cell ran in this process).
    text = compile_train_step(tr, ss, bs).lower(state, batch).compile().as_text()
    gathers = [line for line in text.splitlines() if re.search(r"= \S+\[[^\]]*\][^=]*all-gather(-start)?\(", line)]
    vocab = str(cfg.model.vocab_size)
    assert not [g for g in gathers if re.search(rf"\[[^\]]*\b{vocab}\b", g.split("all-gather")[0])], gathers
    assert not [g for g in gathers if re.search(r"= \(?(f32|bf16|u32)\[", g)], gathers
    assert "all-reduce" in text  # the row-parallel projections and the vocab-parallel softmax reduce
