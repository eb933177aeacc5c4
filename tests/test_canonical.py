"""Canonical numerics (L3): the pair trees, the accumulator, the config rules, and one trajectory on several
meshes (byte equality, with default numerics as the negative control)."""

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from jax.sharding import PartitionSpec as P

from detjax.config import ConfigError, canonical_notes, expert_dispatch, load_config
from detjax.sharding import canonical

MESH_CFG = "configs/tiny_mesh.yaml"
REPO = Path(__file__).resolve().parents[1]


def u32(x) -> np.ndarray:
    return np.asarray(x).view(np.uint32)


def test_pair_sum_is_the_adjacent_pair_tree():
    x = jnp.array([1e8, 1.0, -1e8, 1.0], jnp.float32)
    # tree: (1e8 + 1) + (-1e8 + 1) = 1e8 + -1e8 = 0 in float32; left to right gives 1 (the order matters)
    assert float(canonical.pair_sum(x)) == 0.0
    assert float(((x[0] + x[1]) + x[2]) + x[3]) == 1.0
    y = jax.random.normal(jax.random.key(0), (7, 3), jnp.float32) * jnp.logspace(0, 6, 7)[:, None]
    manual = ((y[0] + y[1]) + (y[2] + y[3])) + ((y[4] + y[5]) + (y[6] + 0.0))  # padded to 8 with zeros
    np.testing.assert_array_equal(u32(canonical.pair_sum(y, 0)), u32(manual))
    np.testing.assert_array_equal(u32(canonical.full_sum(y)), u32(canonical.pair_sum(canonical.pair_sum(y, 1))))


def test_pair_sum_levels_per_pass_do_not_change_bits(monkeypatch):
    """pair_sum reduces blocks of 2**LEVELS terms per pass: the same tree as one level per pass, byte for byte,
    for lengths that are and are not powers of two (padded), on every axis; a left-to-right sum of the same
    terms differs (negative control)."""
    ks = jax.random.split(jax.random.key(4), 3)
    shapes = [(1000,), (37, 3), (5, 64, 6), (2048, 2), (16,), (1,)]
    for shape, key in zip(shapes, jax.random.split(ks[0], len(shapes)), strict=True):
        x = jax.random.normal(key, shape, jnp.float32) * jnp.exp(6 * jax.random.normal(ks[1], shape))
        got = {}
        for levels in (1, 3, 4):  # a fresh function per jit: no trace cache can hide the setting
            monkeypatch.setattr(canonical, "LEVELS", levels)
            for axis in range(len(shape)):
                got[levels, axis] = u32(jax.jit(lambda v, a=axis: canonical.pair_sum(v, a))(x))
            got[levels, "full"] = u32(jax.jit(lambda v: canonical.full_sum(v))(x))
            got[levels, "ops"] = len(jax.make_jaxpr(lambda v: canonical.full_sum(v))(x).eqns)  # fresh trace
        if x.size >= 16:  # the setting took effect: another program (fewer passes, more slices per pass)
            assert got[4, "ops"] != got[1, "ops"], shape
        for levels in (3, 4):
            for axis in range(len(shape)):
                np.testing.assert_array_equal(got[levels, axis], got[1, axis], err_msg=f"{shape} axis {axis}")
            np.testing.assert_array_equal(got[levels, "full"], got[1, "full"], err_msg=f"{shape}")
    x = jax.random.normal(ks[2], (1000,), jnp.float32) * jnp.logspace(-4, 4, 1000)
    left_to_right = np.float32(0)
    for v in np.asarray(x):
        left_to_right = np.float32(left_to_right + v)
    assert u32(canonical.pair_sum(x)) != u32(left_to_right)


@pytest.mark.parametrize("block", [1, 2, 4, 8, 16])
def test_accumulator_over_blocks_is_the_whole_tree(block):
    """Blocks of any power-of-two size, each summed by its own pair tree and pushed in order, give the tree
    over all leaves: the microbatch (or per-device block) size never enters the bits."""
    leaves = jax.random.normal(jax.random.key(1), (16, 5), jnp.float32) * jnp.logspace(-3, 5, 16)[:, None]
    acc = canonical.TreeAccumulator(16 // block)
    state = acc.init(leaves[0])
    for m in range(16 // block):
        state = acc.push(state, canonical.pair_sum(leaves[m * block : (m + 1) * block], 0), m)
    np.testing.assert_array_equal(u32(state["total"]), u32(canonical.pair_sum(leaves, 0)))
    # negative control: a running sum over the same blocks (the default accumulation) has other bits
    running = sum((canonical.pair_sum(leaves[m * block : (m + 1) * block], 0) for m in range(16 // block)), 0.0)
    if 16 // block > 2:  # with two blocks a running sum is the tree
        assert not np.array_equal(u32(running), u32(state["total"]))


def test_accumulator_inside_scan_and_refuses_other_counts():
    leaves = jax.random.normal(jax.random.key(2), (8, 3), jnp.float32) * jnp.logspace(0, 7, 8)[:, None]
    acc = canonical.TreeAccumulator(8)
    out, _ = jax.lax.scan(lambda c, xs: (acc.push(c, xs[0], xs[1]), None), acc.init(leaves[0]), (leaves, jnp.arange(8)))
    np.testing.assert_array_equal(u32(out["total"]), u32(canonical.pair_sum(leaves, 0)))
    with pytest.raises(ValueError, match="power-of-two"):
        canonical.TreeAccumulator(6)


def test_square_sums_do_not_depend_on_the_sharding():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    g = jax.random.normal(jax.random.key(3), (264, 64), jnp.float32)
    want = u32(canonical.square_sums({"g": g})[0])
    for spec in (PartitionSpec("x"), PartitionSpec(None, "x")):
        sharded = jax.device_put(g, NamedSharding(mesh, spec))
        got = jax.jit(lambda t: canonical.square_sums(t)[0])({"g": sharded})
        np.testing.assert_array_equal(u32(got), want)


@pytest.mark.parametrize("k", [1, 2])
def test_reduce_to_shards_is_the_pair_tree_stored_as_sharded(k):
    """reduce_to_shards over data 2 x fsdp 2 x expert 2, each device holding K consecutive terms of every tree
    (device d: terms d*K ..): the sums, left as the storage sharding says -- whole, one dimension over fsdp, one
    over (fsdp, expert), two dimensions over data and expert, a scalar -- are pair_sum over the 8*K stacked
    terms, byte for byte, with one all-to-all. Negative control: a left-to-right sum of the terms gives other
    bits."""
    from detjax.jaxprs import iter_eqns

    axes = ("data", "fsdp", "expert")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), axes)
    degrees = {"data": 2, "fsdp": 2, "expert": 2}
    cases = [
        ((6, 5), P()),
        ((4, 3), P("fsdp")),
        ((3, 8, 2), P(None, ("fsdp", "expert"))),
        ((4, 6), P("data", "expert")),
        ((), P()),
    ]
    terms = [jax.random.normal(jax.random.key(i), (8 * k, *sh), jnp.float32) for i, (sh, _) in enumerate(cases)]
    specs = [sp for _, sp in cases]

    def local(*xs):
        mine = [x if k > 1 else x[0] for x in xs]  # this device's K terms (one: no leading axis)
        return tuple(canonical.reduce_to_shards(mine, specs, axes, degrees, k))

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(axes),) * len(cases), out_specs=tuple(specs), check_vma=False)
    got = jax.jit(fn)(*terms)
    for x, out in zip(terms, got, strict=True):
        np.testing.assert_array_equal(u32(out), u32(canonical.pair_sum(x, 0)))
    eqns = [e.primitive.name for e in iter_eqns(jax.make_jaxpr(fn)(*terms).jaxpr)]
    assert eqns.count("all_to_all") == 1, eqns
    left = terms[0][0]
    for i in range(1, 8 * k):
        left = left + terms[0][i]
    assert not np.array_equal(u32(left), u32(canonical.pair_sum(terms[0], 0))), "negative control: another order"


def test_config_rules():
    canon = ["determinism.numerics=canonical"]
    # tensor parallelism needs the fixed chunk count, and every split dimension must divide into it
    with pytest.raises(ConfigError, match=r"mesh\.tensor.*Fix: set determinism\.max_tensor=2"):
        load_config(MESH_CFG, canon + ["mesh.tensor=2"])
    with pytest.raises(ConfigError, match=r"model\.n_kv_heads' = 4: must be divisible by determinism\.max_tensor = 8"):
        load_config(MESH_CFG, canon + ["determinism.max_tensor=8"])
    load_config(MESH_CFG, canon + ["determinism.max_tensor=4", "mesh.tensor=4"])
    with pytest.raises(ConfigError, match=r"max_tensor.*power of two"):
        load_config(MESH_CFG, canon + ["determinism.max_tensor=3"])
    with pytest.raises(ConfigError, match=r"max_tensor.*only under determinism.numerics=canonical"):
        load_config(MESH_CFG, ["determinism.max_tensor=2"])
    load_config(MESH_CFG, canon + ["determinism.max_tensor=4", "mesh.tensor=4", "mesh.sequence_parallel=true"])
    with pytest.raises(ConfigError, match=r"sequence parallelism is not built inside pipeline stages"):
        load_config(
            MESH_CFG,
            canon
            + ["determinism.max_tensor=2", "mesh.tensor=2", "mesh.sequence_parallel=true", "mesh.pipeline=2"]
            + ["train.micro_batch=1", "model.pattern='M*E-M*E-'"],
        )
    load_config(  # tensor parallelism inside canonical pipeline stages
        MESH_CFG,
        canon
        + ["determinism.max_tensor=2", "mesh.tensor=2", "mesh.pipeline=2", "train.micro_batch=1"]
        + ["model.pattern='M*E-M*E-'"],
    )
    load_config(MESH_CFG, canon + ["determinism.max_tensor=2", "mesh.tensor=2", *PALLAS])
    gmm_chunks = r"moe\.ffn_dim' = 32: the Pallas grouped matmul takes each of the .* = 4 chunks"
    with pytest.raises(ConfigError, match=gmm_chunks):
        load_config(MESH_CFG, canon + ["determinism.max_tensor=4", *PALLAS])
    load_config(MESH_CFG, canon + ["determinism.max_tensor=2", "mesh.tensor=2", "model.fp8.enabled=true"])
    # the chunk count is part of the trajectory; the tensor degree is not
    four = canon + ["determinism.max_tensor=4"]
    assert load_config(MESH_CFG, four).hash() != load_config(MESH_CFG, canon).hash()
    assert (
        load_config(MESH_CFG, four + ["mesh.tensor=4"]).hash() == load_config(MESH_CFG, four + ["mesh.data=8"]).hash()
    )
    # a canonical pipeline's microbatches are the leaves
    with pytest.raises(ConfigError, match=r"train\.micro_batch.*must equal determinism\.canonical_leaf = 1"):
        load_config(MESH_CFG, canon + ["mesh.pipeline=2", "model.pattern='M*E-M*E-'"])
    load_config(
        MESH_CFG, canon + ["mesh.pipeline=2", "mesh.expert=2", "train.micro_batch=1", "model.pattern='M*E-M*E-'"]
    )
    # an expert axis is allowed: with the XLA grouped matmuls as storage sharding with no token dispatch, and the
    # trainer says so; with the Pallas ones the rows travel to their experts (test_expert_dispatch_... below)
    assert "no all-to-all token dispatch" in " ".join(canonical_notes(load_config(MESH_CFG, canon + ["mesh.expert=2"])))
    pallas_ep = load_config(MESH_CFG, canon + ["mesh.expert=2", "model.moe.experts_impl=pallas"])
    assert expert_dispatch(pallas_ep) and canonical_notes(pallas_ep) == []
    assert expert_dispatch(
        load_config(
            MESH_CFG,
            [*canon, "mesh.expert=2", "mesh.tensor=2", "determinism.max_tensor=2", "model.moe.experts_impl=pallas"],
        )
    )
    pp_ep = ["mesh.expert=2", "mesh.pipeline=2", "train.micro_batch=1", "model.pattern='M*E-M*E-'"]
    assert not expert_dispatch(load_config(MESH_CFG, [*canon, *pp_ep, "model.moe.experts_impl=pallas"]))
    assert canonical_notes(load_config(MESH_CFG, canon + ["mesh.data=8"])) == []
    assert canonical_notes(load_config(MESH_CFG, ["mesh.expert=2"])) == []
    with pytest.raises(ConfigError, match=r"train\.global_batch.*power of two"):
        load_config(MESH_CFG, canon + ["train.global_batch=12", "train.micro_batch=4"])
    with pytest.raises(ConfigError, match=r"trace\.level.*numerics=default"):
        load_config(MESH_CFG, canon + ["trace.level=phase", "trace.steps=1"])
    with pytest.raises(ConfigError, match="needs determinism.mode=strict"):
        load_config(MESH_CFG, canon + ["determinism.mode=off"])
    with pytest.raises(ConfigError, match=r"canonical_leaf.*power of two dividing"):
        load_config(MESH_CFG, canon + ["determinism.canonical_leaf=3"])
    with pytest.raises(ConfigError, match=r"canonical_leaf.*only under determinism.numerics=canonical"):
        load_config(MESH_CFG, ["determinism.canonical_leaf=2"])
    # the leaf size is part of the trajectory (it is the aux-loss group and the dropout-key unit)
    assert load_config(MESH_CFG, canon).hash() != load_config(MESH_CFG, canon + ["determinism.canonical_leaf=2"]).hash()
    # the mesh and the microbatch size are not part of a canonical run's identity; they are of a default run's
    a, b = (load_config(MESH_CFG, canon + o) for o in (["mesh.data=8"], ["mesh.fsdp=8", "train.micro_batch=2"]))
    assert a.hash() == b.hash()
    c, d = (load_config(MESH_CFG, o) for o in (["mesh.data=8"], ["mesh.fsdp=8", "train.micro_batch=2"]))
    assert c.hash() != d.hash()


MLP_MODEL = ("model.pattern='-'", "model.mtp.depth=0")  # one MLP block, no MTP head


def _one_step(overrides: list[str], model: tuple[str, ...] = MLP_MODEL, steps=1, rows=None):
    """(parameters, metrics) after `steps` steps on one fixed batch; `rows`: that batch's sequences in this order."""
    from detjax.sharding.mesh import build_layout
    from detjax.step import Trainer, compile_init

    cfg = load_config(MESH_CFG, [*model, *overrides])
    layout = build_layout(cfg, jax.devices()[: cfg.mesh.devices or 8])
    tr = Trainer(cfg, layout)
    ssh, bsh = tr.state_shardings(), tr.batch_sharding()
    state = compile_init(tr, ssh)(jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (cfg.train.global_batch, cfg.train.seq_len + 1), 0, 264)
    batch = batch if rows is None else batch[np.asarray(rows)]
    step = jax.jit(tr.train_step, in_shardings=(ssh, bsh))
    for _ in range(steps):  # step 0 has lr 0 under warm-up; step 1 is the first AdamW update
        state, metrics = step(state, jax.device_put(batch, bsh))
    return jax.device_get(state.params), jax.device_get(metrics)


def _check_leaf_pairs(monkeypatch, model: tuple[str, ...]) -> None:
    """Two canonical steps of 16 one-sequence leaves on one device (groups of STACK = 4 leaves) with the paired
    leaf scan give the unpaired scan's parameter bytes, and with sequences 1 and 2 swapped in the batch (no
    dropout: the same leaf gradients in other pairs) other bytes."""
    from detjax import step_canonical

    canon = ["model.dropout=0.0", "determinism.numerics=canonical", "mesh.devices=1", "run.tensorboard=false"]

    def run(pairs: bool, rows=None):
        monkeypatch.setattr(step_canonical, "PAIRS", pairs)
        return _one_step(canon, model, steps=2, rows=rows)[0]

    paired = run(True)
    assert _same(run(False), paired)
    assert not _same(run(True, [0, 2, 1, *range(3, 16)]), paired)  # negative control (tiny_mesh's 16 sequences)


def test_leaf_pairs_give_the_unpaired_bytes(monkeypatch):
    """The paired leaf scan (two leaves a scan step, their gradients added before the stack: the pair tree's
    first level, step_canonical.PAIRS, the GPU default) gives the unpaired scan's bytes (_check_leaf_pairs, on
    an MLP model). Negative control: swapped sequences in the batch change them."""
    _check_leaf_pairs(monkeypatch, MLP_MODEL)


@pytest.mark.gpu
def test_leaf_pairs_give_the_unpaired_bytes_on_gpu(monkeypatch):
    """The same on the GPU, where pairs are the default, with tiny_mesh's hybrid (Mamba2, attention, MoE, MTP):
    XLA compiles the paired and unpaired programs for the GPU, and their bytes must agree there too."""
    _check_leaf_pairs(monkeypatch, ())


def _same(a, b) -> bool:
    return all(np.array_equal(u32(x), u32(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


_HYBRID_REF: dict = {}


def _hybrid_canonical(mesh: list[str]):
    """Two canonical steps of tiny_mesh's own hybrid (M*E- and MTP), computed once per mesh in this process."""
    key = tuple(mesh)
    if key not in _HYBRID_REF:
        _HYBRID_REF[key] = _one_step(["determinism.numerics=canonical", *mesh], (), steps=2)
    return _HYBRID_REF[key]


def _assert_step_equal(got, ref, what) -> None:
    assert _same(got[0], ref[0]), what
    digests = [json.dumps(jax.tree.map(lambda v: u32(v).tolist(), r[1]["digest"])) for r in (got, ref)]
    assert digests[0] == digests[1], what


@pytest.mark.extended  # ~115 s on 2 cores; the default run has a canonical hybrid step against one device on
# expert 4 x data 2 (test_expert_dispatch_is_byte_equal_to_one_device)
def test_one_step_is_byte_equal_across_meshes_and_microbatch_sizes():
    """Canonical: two steps (the second is the first with a nonzero learning rate, so AdamW's update counts)
    on one device and on fsdp 2 x expert 2 x data 2 with another microbatch size give the same parameters and
    step metrics (digests included), byte for byte, for the hybrid model (Mamba2, attention, MoE, MLP blocks and the
    MTP head of configs/tiny_mesh.yaml; data 8: the extended variant below, the two-process test and the mesh
    sweep). Default numerics differ with the microbatch size."""
    ref = _hybrid_canonical(["mesh.devices=1"])
    mesh = ["mesh.fsdp=2", "mesh.expert=2", "mesh.data=2", "train.micro_batch=2"]
    _assert_step_equal(_hybrid_canonical(mesh), ref, mesh)
    # negative control: default numerics accumulate microbatches in sequence, so their size changes the bits
    mb8, mb2 = _one_step(["mesh.devices=1"]), _one_step(["mesh.devices=1", "train.micro_batch=2"])
    assert not _same(mb8, mb2), "negative control: default numerics should change with the microbatch size"


EP = ["determinism.numerics=canonical", "model.moe.experts_impl=pallas", "model.pattern='E-'", "model.mtp.depth=0"]


EP_CANON = [*EP, "determinism.max_tensor=2"]  # the dispatch tests' model with two width chunks


def _dispatch_ref():
    """Two canonical steps of the dispatch tests' model on one device."""
    return _one_step([*EP_CANON, "mesh.devices=1"], (), steps=2)


def test_expert_dispatch_is_byte_equal_to_one_device(monkeypatch):
    """Canonical expert parallelism with token dispatch (the Pallas grouped matmuls; interpret mode here): on
    expert 4 x data 2 each device keeps its two experts, sends every leaf's rows to their experts' owners by
    all-to-all and gets one weight gradient per source device. Two steps give the one-device parameters and
    digests byte for byte (tensor 2 x expert 2 x data 2: the extended test below).
    Negative control: the owner files each source's gradient under the next source (a rotation of the
    per-source copies: the same values, so the forward does not change) and the bits move, so the test sees
    where each source's subtree enters the tree."""
    from detjax.sharding import expert
    from detjax.sharding.mesh import build_layout
    from detjax.step import Trainer

    ep4 = ["mesh.expert=4", "mesh.data=2"]
    cfg = load_config(MESH_CFG, [*EP_CANON, *ep4])
    tr = Trainer(cfg, build_layout(cfg, jax.devices()))
    assert tr.expert_split is not None and tr.expert_split.degree == 4
    ref = _dispatch_ref()
    _assert_step_equal(_one_step([*EP_CANON, *ep4], (), steps=2), ref, ep4)

    local = expert._local

    def misfiled(x, idx, gate, *ws_and_scales, **kw):  # source a's rows read copy a + 1 (mod A)
        ws = [jnp.roll(w, 1, axis=0) for w in ws_and_scales[:3]]
        return local(x, idx, gate, *ws, *ws_and_scales[3:], **kw)

    monkeypatch.setattr(expert, "_local", misfiled)
    bad = _one_step([*EP_CANON, *ep4], (), steps=2)
    assert not _same(bad[1]["digest"], ref[1]["digest"]), "negative control: misfiled gradients should change bits"


@pytest.mark.extended  # split off the test above (~100 s cold with both meshes), which keeps expert 4 x data 2
def test_expert_dispatch_with_expert_width_chunks_is_byte_equal_to_one_device():
    """Canonical expert dispatch on tensor 2 x expert 2 x data 2 (sequence parallel): each owner also holds one
    of the two feature chunks of its experts' width (determinism.max_tensor = 2). Two steps give the one-device
    parameters and digests byte for byte. Negative control: default numerics on that mesh give other bits."""
    mesh = ["mesh.tensor=2", "mesh.expert=2", "mesh.data=2", "mesh.sequence_parallel=true"]
    ref = _dispatch_ref()
    _assert_step_equal(_one_step([*EP_CANON, *mesh], (), steps=2), ref, mesh)
    default = _one_step([o for o in EP if not o.startswith("determinism.numerics")] + mesh, (), steps=2)
    assert not _same(default[0], ref[0]), "negative control: default numerics should change the bits"


@pytest.mark.extended  # ~65 s on 2 cores: the fp8 grouped products beside the dispatch test above
def test_expert_dispatch_with_fp8_is_byte_equal_to_one_device():
    """Canonical expert dispatch with model.fp8 (expert 2 x data 2 x fsdp 2): each owner's amaxes cover the rows
    it received and its own experts, and the maximum over devices and leaves is one device's: two steps give
    its parameters, scales and amax histories byte for byte. Negative control: fp8 off gives other bits."""
    mesh = ["mesh.expert=2", "mesh.data=2", "mesh.fsdp=2"]
    ref = _state_after([*EP, "model.fp8.enabled=true", "mesh.devices=1"], (), 2)
    got = _state_after([*EP, "model.fp8.enabled=true", *mesh], (), 2)
    assert _same(got[:2], ref[:2]) and _same(got[2]["digest"], ref[2]["digest"])
    bf16 = _one_step([*EP, *mesh], (), steps=2)
    assert not _same(bf16[0], ref[0]), "negative control: fp8 off should give other bits"


TP = ["determinism.numerics=canonical", "determinism.max_tensor=8", "model.n_kv_heads=8"]
_TP_REF: dict = {}


def _tp_step(mesh: list[str]):
    """Two canonical steps of tiny_mesh's hybrid (M*E- and MTP) with 8 feature chunks, once per mesh."""
    key = tuple(mesh)
    if key not in _TP_REF:
        _TP_REF[key] = _one_step([*TP, *mesh], (), steps=2)
    return _TP_REF[key]


@pytest.mark.extended  # ~115 s; the default run has canonical tensor parallelism against one device in kind:
# test_fp8_with_tensor_parallelism_is_mesh_invariant and test_pallas_kernels_in_tensor_chunks (tensor 2), and
# test_sequence_parallel_mixers_end_in_a_reduce_scatter (the sequence-parallel program)
def test_tensor_parallel_is_byte_equal_to_one_device():
    """Canonical tensor parallelism (determinism.max_tensor = 8): tensor 2 x data 4 with sequence parallelism
    gives the one-device run's two steps of the hybrid (Mamba2 heads, attention heads, MoE expert widths,
    MLP, vocabulary-parallel embedding and cross-entropy, MTP; the residual stream split along the sequence
    between blocks) byte for byte, digests included. Negative control: under default numerics tensor
    parallelism changes the bits (the partitioner's all-reduces)."""
    mesh = ["mesh.tensor=2", "mesh.sequence_parallel=true"]
    _assert_step_equal(_tp_step(mesh), _tp_step(["mesh.devices=1"]), "tensor 2 x data 4, sequence parallel")
    one, two = _one_step(["mesh.devices=1"]), _one_step(["mesh.tensor=2", "mesh.data=1", "mesh.devices=2"])
    assert not _same(one, two), "negative control: default numerics should change with the tensor degree"


def test_sequence_parallel_mixers_end_in_a_reduce_scatter():
    """With sequence parallelism the attention, MLP and Mamba2 blocks of the hybrid end in
    tensor.combine_piece: one all_to_all over `tensor` per such block in the forward (its transpose, an
    all-gather, in the backward), so each device adds the top of the chunk tree on its own piece of the
    sequence only (the bits: test_tensor_parallel_is_byte_equal_to_one_device). Negative control: without
    sequence parallelism the step has no all_to_all."""
    from detjax.jaxprs import iter_eqns
    from detjax.sharding.mesh import build_layout
    from detjax.step import Trainer

    def all_to_alls(mesh):
        cfg = load_config(MESH_CFG, [*TP, *mesh])
        tr = Trainer(cfg, build_layout(cfg, jax.devices()[:8]))
        batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len + 1), jnp.int32)
        jaxpr = jax.make_jaxpr(tr.train_step)(tr.abstract_state(), batch)
        eqns = [e for e in iter_eqns(jaxpr.jaxpr) if e.primitive.name == "all_to_all"]
        # over `tensor` only: the gradient tree's top levels exchange over the batch axes (reduce_to_shards)
        return [e for e in eqns if "tensor" in str(e.params["axis_name"])]

    got = all_to_alls(["mesh.tensor=2", "mesh.sequence_parallel=true"])
    assert len(got) == 3, [e.params for e in got]  # M, * and - of M*E- (the MTP block runs the whole sequence)
    assert not all_to_alls(["mesh.tensor=2"]), "negative control: no reduce-scatter without sequence parallelism"


@pytest.mark.extended  # ~3 min on 2 cores
@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.tensor=8", "mesh.data=1"],
        ["mesh.tensor=2", "mesh.expert=2"],
        ["mesh.tensor=4", "mesh.fsdp=2", "mesh.data=1"],
        ["mesh.tensor=4", "mesh.sequence_parallel=true"],
        ["mesh.tensor=2"],
    ],
)
def test_tensor_parallel_cells_are_byte_equal_to_one_device(mesh):
    """tp8 (one chunk per device), tp2 x ep2 x data 2, tp4 x fsdp 2, tp4 with sequence parallelism (x data
    2) and tensor 2 x data 4 without it give the one-device run's bits."""
    _assert_step_equal(_tp_step(mesh), _tp_step(["mesh.devices=1"]), mesh)


@pytest.mark.extended  # ~4 min on 2 cores
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_tensor_parallel_pipeline_is_byte_equal_to_one_device(schedule):
    """tp2-pp2 and dp2-tp2-pp2 (tensor 2 x pipeline 2 x data 2, 1F1B and GPipe): the stages run the feature
    chunks on their tensor shards, and the hybrid M*E-M*E- with MTP gives the one-device run's two steps."""
    model = ("model.pattern='M*E-M*E-'",)
    canon = [*TP, "train.micro_batch=1"]
    ref = _one_step([*canon, "mesh.devices=1"], model, steps=2)
    mesh = ["mesh.tensor=2", "mesh.pipeline=2", f"mesh.schedule={schedule}"]
    _assert_step_equal(_one_step([*canon, *mesh], model, steps=2), ref, mesh)


@pytest.mark.extended  # ~1 min on 2 cores
def test_feature_chunks_compute_the_same_function():
    """The chunked model (max_tensor = 8, one device) is the same function as the unchunked one: its step-0
    gradient sums agree to bf16 rounding (allclose: a check of the math, not of determinism), and are not the
    same bits (the chunk trees change the order)."""
    from detjax.sharding.mesh import build_layout
    from detjax.step import Trainer, compile_init

    out = []
    for big in (1, 8):
        cfg = load_config(MESH_CFG, [*TP[:1], "model.n_kv_heads=8", f"determinism.max_tensor={big}", "mesh.devices=1"])
        tr = Trainer(cfg, build_layout(cfg, jax.devices()[:1]))
        state = compile_init(tr, tr.state_shardings())(jax.random.key(0))
        batch = jax.random.randint(jax.random.key(1), (cfg.train.global_batch, cfg.train.seq_len + 1), 0, 264)
        g, terms, _ = jax.jit(lambda s, b, tr=tr: tr.canonical_grad_sums(s.params, b, tr.step_key(s)))(state, batch)
        out.append(jax.device_get((g, terms)))
    (g1, t1), (g8, t8) = out
    for a, b in zip(t1, t8, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-3)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8), strict=True):
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.02 * float(np.abs(a).max()) + 1e-6)
    assert not _same(g1, g8)


@pytest.mark.parametrize(
    "pattern",
    # both `-m extended` (E-E- ~90 s, the hybrid ~3 min on 2 cores): the default run's fp8 canonical pipeline
    # test runs the same canonical pipeline (pipeline 2 x data 4 = one device) with fp8 on
    [pytest.param("E-E-", marks=pytest.mark.extended), pytest.param("M*E-M*E-", marks=pytest.mark.extended)],
)
def test_pipeline_is_byte_equal_to_one_device(pattern):
    """Canonical through the pipeline, with MTP and dropout: pp2 x data 4 (1F1B, each data shard pipelining its
    own 4 leaves; the MTP head's embedding gradient sent back to the first stage, the MoE aux sum carried with
    the activations) gives the one-device run's two steps byte for byte, digests included. Negative control:
    the default-numerics pipeline (a running sum over microbatches, psums over the ranks) differs from it."""
    model = (f"model.pattern='{pattern}'",)
    canon = ["determinism.numerics=canonical"]
    ref = _one_step([*canon, "mesh.devices=1"], model, steps=2)
    _assert_step_equal(_one_step([*canon, "mesh.pipeline=2", "train.micro_batch=1"], model, steps=2), ref, "pp2")
    default_pp = _one_step(["mesh.pipeline=2", "mesh.data=1", "mesh.devices=2"], model, steps=2)
    assert not _same(default_pp[0], ref[0]), "negative control: the default pipeline should differ"


@pytest.mark.extended
def test_one_step_is_byte_equal_on_data_8():
    """The same two canonical hybrid steps on data 8 (one sequence per device) as on one device."""
    _assert_step_equal(_hybrid_canonical(["mesh.data=8"]), _hybrid_canonical(["mesh.devices=1"]), "data=8")


_LEAVES_PER_SCAN = """
import json, jax, numpy as np
from detjax import step as st
from detjax.config import load_config
over = ["determinism.numerics=canonical", "mesh.devices=1", "model.pattern='M*E-M*E-'"]
cfg = load_config("configs/tiny_mesh.yaml", over)
tr = st.Trainer(cfg, None)
state = tr.init_state(jax.random.key(0))
batch = jax.random.randint(jax.random.key(1), (16, cfg.train.seq_len + 1), 0, 264)
key = tr.step_key(state)
out = {}
for stack in (4, 1):
    st.step_canonical.STACK = stack
    fn = jax.jit(lambda p, b, k: tr.canonical_grad_sums(p, b, k)[:2])
    out[stack] = [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(fn(state.params, batch, key))]
other = [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(fn(state.params, batch.at[3, 5].set(7), key))]
same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
print("RESULT " + json.dumps({"equal": same(out[4], out[1]), "control_equal": same(other, out[1])}))
"""


@pytest.mark.slow
@pytest.mark.extended  # ~3 min on 2 cores: a fresh process compiling two 16-leaf steps at the default XLA level
def test_leaves_per_scan_do_not_change_the_gradient_sums(python):
    """One device, 16 one-sequence leaves of the two-layer-group hybrid: scans of 4 leaves (step.STACK 4) and
    sixteen single-leaf groups (whose length-1 scans XLA inlines) give the same gradient and loss sums, byte
    for byte. It runs in a process with XLA's default optimization level (the suite's -O0 hides the effect):
    before the leaf gradients passed an optimization barrier and Mamba2's decay gradient summed rounded
    products by a pair tree, XLA fused a leaf's last products into the adds after them differently in the two
    programs, and layer_0's and layer_4's a_log gradients differed in 4 and 2 elements. Negative control: one
    changed token changes the compared bytes."""
    import subprocess

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_ENABLE_COMPILATION_CACHE="false")
    out = subprocess.run([python, "-c", _LEAVES_PER_SCAN], capture_output=True, text=True, env=env, cwd=REPO)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stderr[-3000:]
    res = json.loads(line[0][7:])
    assert res["equal"]
    assert not res["control_equal"], "negative control: another token should change the sums"


def test_a_mesh_with_more_batch_devices_than_leaves_is_refused():
    from detjax.sharding.mesh import build_layout
    from detjax.step import Trainer

    cfg = load_config(MESH_CFG, ["determinism.numerics=canonical", "determinism.canonical_leaf=4", "mesh.data=8"])
    with pytest.raises(ConfigError, match=r"dividing the 4 leaves.*smaller determinism\.canonical_leaf"):
        Trainer(cfg, build_layout(cfg, jax.devices()[:8]))


# ~35 s on 2 cores. Covered in kind by test_pallas_kernels_on_a_batch_mesh below (leaves of 2 sequences: one
# device stacks them, fsdp 2 x data 2 holds one per device).
@pytest.mark.extended
def test_leaves_of_several_sequences_are_mesh_invariant():
    """Canonical with determinism.canonical_leaf=4: one device (four leaves stacked by one scan) and data 4
    (one leaf per device, the devices joined by the top of the tree) give the same step, byte for byte. The
    leaf size is part of the trajectory: one-sequence leaves give other bits (the negative control)."""
    canon = ["determinism.numerics=canonical", "determinism.canonical_leaf=4"]
    ref = _one_step(canon + ["mesh.devices=1"])
    got = _one_step(canon + ["mesh.devices=4", "mesh.data=4"])
    assert _same(got[0], ref[0]) and _same(got[1]["digest"], ref[1]["digest"])
    one = _one_step(["determinism.numerics=canonical", "mesh.devices=1"])
    assert not _same(one[1]["digest"], ref[1]["digest"]), "negative control: the leaf size should change the bits"


def test_fp8_scales_are_mesh_invariant():
    """Canonical numerics with model.fp8: two steps (step 1 scales its products by the amax history of step 0)
    on one device and on fsdp 2 x data 4 give the same parameters, digests and fp8 collection (scales and
    amax histories), byte for byte: an amax is the maximum over the leaves, exact in any order. Negative
    control: without fp8 the bits differ (the fp8 path is what ran)."""
    canon = ["determinism.numerics=canonical", "model.fp8.enabled=true", "model.fp8.amax_history_len=3"]
    ref = _one_step([*canon, "mesh.devices=1"], steps=2)
    got = _one_step([*canon, "mesh.fsdp=2", "mesh.data=4"], steps=2)
    assert "collections" in ref[1]["digest"]
    assert _same(got[0], ref[0]) and _same(got[1]["digest"], ref[1]["digest"])
    bf16 = _one_step(["determinism.numerics=canonical", "mesh.devices=1"], steps=2)
    assert not _same(bf16[0], ref[0]), "negative control: fp8 off should give other bits"


def _state_after(overrides: list[str], model: tuple[str, ...], steps: int):
    """The train state after `steps` steps (parameters and collections in the one-device layout)."""
    from detjax.sharding import pipeline
    from detjax.sharding.mesh import build_layout
    from detjax.step import Trainer, compile_init

    cfg = load_config(MESH_CFG, [*model, *overrides])
    tr = Trainer(cfg, build_layout(cfg, jax.devices()[: cfg.mesh.devices or 8]))
    ssh, bsh = tr.state_shardings(), tr.batch_sharding()
    state = compile_init(tr, ssh)(jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (cfg.train.global_batch, cfg.train.seq_len + 1), 0, 264)
    step = jax.jit(tr.train_step, in_shardings=(ssh, bsh))
    for _ in range(steps):
        state, metrics = step(state, jax.device_put(batch, bsh))
    state, metrics = jax.device_get((state, metrics))
    if tr.stacked:
        fp8_state = {k: pipeline.unstack_params(v, cfg) for k, v in state.collections["fp8"].items()}
        return pipeline.unstack_params(state.params, cfg), fp8_state, metrics
    return state.params, state.collections["fp8"], metrics


FP8_PIPE_MODEL = ("model.pattern='--'", "model.fp8.enabled=true", "model.fp8.amax_history_len=3")


@pytest.mark.extended  # ~55 s on 2 cores; in kind in the default run: test_fp8_scales_are_mesh_invariant (fp8 amaxes
# as maxima over the leaves), test_pipeline_is_byte_equal_to_one_device (the canonical pipeline) and
# test_fp8_through_a_default_pipeline_takes_every_stages_amaxes (the scale sets through the stages)
def test_fp8_through_a_canonical_pipeline_is_mesh_invariant():
    """Canonical numerics with model.fp8 through the pipeline (pipeline 2 x data 4; MLP blocks and the MTP
    head, whose scale sets live outside the stages): each chunk and head runs with the step's scales and its
    amaxes are the maximum over microbatches, ranks and batch shards, so two steps give one device's
    parameters, scales and amax histories, byte for byte. Negative control: fp8 off gives other bits."""
    canon = ["determinism.numerics=canonical", "train.micro_batch=1"]
    ref = _state_after([*canon, "mesh.devices=1"], FP8_PIPE_MODEL, 2)
    got = _state_after([*canon, "mesh.pipeline=2"], FP8_PIPE_MODEL, 2)
    assert "mtp_proj_h" in ref[1]["scale"]  # an outer scale set (the MTP head's), besides the stages'
    assert _same(got[:2], ref[:2]) and _same(got[2]["digest"], ref[2]["digest"])
    bf16 = _one_step([*canon, "mesh.devices=1"], FP8_PIPE_MODEL[:1], steps=2)
    assert not _same(bf16[0], ref[0]), "negative control: fp8 off should give other bits"


@pytest.mark.extended  # ~35 s on 2 cores; beside the fp8 canonical pipeline test above
def test_fp8_lm_head_through_a_canonical_pipeline_is_mesh_invariant():
    """model.fp8.lm_head through the canonical pipeline (pipeline 2 x data 4): the LM and MTP heads' one
    scale set ("head", outside the stages) takes the maximum over both heads, microbatches, ranks and batch
    shards, so two steps give one device's parameters, scales and histories, byte for byte. Negative
    control: the head in bf16 gives other parameters."""
    canon = ["determinism.numerics=canonical", "train.micro_batch=1", "mesh.devices=1"]
    model = (*FP8_PIPE_MODEL, "model.fp8.lm_head=true")
    ref = _state_after(canon, model, 2)
    got = _state_after([*canon[:2], "mesh.pipeline=2"], model, 2)
    assert "head" in ref[1]["scale"]
    assert _same(got[:2], ref[:2]) and _same(got[2]["digest"], ref[2]["digest"])
    assert not _same(_state_after(canon, FP8_PIPE_MODEL, 2)[0], ref[0]), "negative control: a bf16 head"


def test_fp8_through_a_default_pipeline_takes_every_stages_amaxes():
    """Default numerics with model.fp8 through the pipeline (pipeline 2 x data 4, the state stacked by stage):
    after one step every scale set's weight amax is the one-device run's, byte for byte (the same initial
    weights; the activations' amaxes may differ, as default numerics do across meshes), and every
    activation and gradient amax is set (positive). Negative control: the stages' histories before the step
    are zero."""
    ref = _state_after(["mesh.devices=1"], FP8_PIPE_MODEL, 1)[1]["amax_history"]
    got = _state_after(["mesh.pipeline=2"], FP8_PIPE_MODEL, 1)[1]["amax_history"]
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for h_ref, h_got in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        assert np.array_equal(u32(h_got[1, 0]), u32(h_ref[1, 0]))  # w's amax of step 0
        assert (np.asarray(h_got[:, 0]) > 0).all() and (np.asarray(h_got[:, 1:]) == 0).all()


@pytest.mark.extended  # the hybrid (experts) compiled three times: ~3 min on 2 cores
def test_fp8_with_an_expert_axis_is_mesh_invariant():
    """Canonical numerics with model.fp8 on expert 2 x data 4 (the experts' weights sharded over `expert`,
    their fp8 scale sets' amaxes maxima over the leaves): two steps byte-equal to one device, parameters,
    digests and fp8 collection. Negative control: without fp8 the bits differ."""
    canon = ["determinism.numerics=canonical", "model.fp8.amax_history_len=3"]
    ref = _one_step([*canon, "model.fp8.enabled=true", "mesh.devices=1"], (), steps=2)
    got = _one_step([*canon, "model.fp8.enabled=true", "mesh.expert=2"], (), steps=2)
    assert "collections" in ref[1]["digest"]
    assert _same(got[0], ref[0]) and _same(got[1]["digest"], ref[1]["digest"])
    bf16 = _one_step([*canon, "mesh.expert=2"], (), steps=2)
    assert not _same(bf16[0], got[0]), "negative control: fp8 off should give other bits"


@pytest.mark.parametrize(
    "model",
    [
        # ~35 s on 2 cores; in kind in the default run: test_fp8_scales_are_mesh_invariant (amaxes as maxima
        # over leaves) and test_pallas_kernels_in_tensor_chunks (canonical tensor chunks against one device)
        pytest.param(MLP_MODEL, id="mlp", marks=pytest.mark.extended),
        pytest.param((), id="hybrid", marks=pytest.mark.extended),  # Mamba2, attention, experts, MTP: ~1 min
    ],
)
def test_fp8_with_tensor_parallelism_is_mesh_invariant(model):
    """Canonical tensor parallelism with model.fp8 (max_tensor = 8): each feature chunk multiplies in fp8 with
    its projection's scale set, and a scale set's amax is the maximum over its chunks and tensor devices
    (tensor.max_copies). Two steps (the second scaled by the first's amaxes) on tensor 2 x data 4 with
    sequence parallelism and on one device give the same parameters, digests and fp8 collection, byte for
    byte. Negative control: without fp8 the bits differ."""
    fp8_on = ["model.fp8.enabled=true", "model.fp8.amax_history_len=3"]
    ref = _one_step([*TP, *fp8_on, "mesh.devices=1"], model, steps=2)
    got = _one_step([*TP, *fp8_on, "mesh.tensor=2", "mesh.sequence_parallel=true"], model, steps=2)
    assert "collections" in ref[1]["digest"]
    assert _same(got[0], ref[0]) and _same(got[1]["digest"], ref[1]["digest"])
    bf16 = _one_step([*TP, "mesh.devices=1"], model, steps=2)
    assert not _same(bf16[0], ref[0]), "negative control: fp8 off should give other bits"


PALLAS = ["model.kernels=pallas", "model.head_dim=16", "model.mamba.d_state=16", "model.mamba.chunk_size=16"]


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(MLP_MODEL, id="mlp"),
        # flash attention, SSD, gmm/tgmm, RMSNorm and the matmul inside the feature chunks
        pytest.param((), id="hybrid", marks=pytest.mark.extended),
    ],
)
def test_pallas_kernels_in_tensor_chunks(model):
    """Canonical tensor parallelism with the Pallas kernels (the kernels strategy's GPU path; interpret mode
    here): each feature chunk's products are the pinned-tile matmul, its attention, scan and expert
    products the flash, SSD and gmm kernels, and tensor 2 x data 2 gives the one-device step byte for
    byte. Negative control: the XLA path's chunks give other bits."""
    # the experts' width (32) in 2 chunks of 16: the Pallas gmm's smallest tile
    canon = ["determinism.numerics=canonical", "determinism.canonical_leaf=2", "determinism.max_tensor=2", *PALLAS]
    ref = _one_step(canon + ["mesh.devices=1"], model)
    got = _one_step(canon + ["mesh.devices=4", "mesh.tensor=2", "mesh.data=2"], model)
    assert _same(got[0], ref[0]) and _same(got[1]["digest"], ref[1]["digest"])
    other = _one_step([*canon, "model.kernels=reference", "mesh.devices=1"], model)
    assert not _same(other[1]["digest"], ref[1]["digest"]), "negative control: other kernels, other bits"


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(MLP_MODEL, id="mlp"),
        # every kernel (flash attention, SSD, gmm/tgmm, RMSNorm, matmul, segment sum): ~5 min on 2 cores
        pytest.param((), id="hybrid", marks=pytest.mark.extended),
    ],
)
def test_pallas_kernels_on_a_batch_mesh(model):
    """Canonical numerics runs the model inside shard_map, one leaf per device with whole weights, so the
    Pallas kernels (the kernels strategy on a GPU; interpret mode here) run on data and fsdp meshes: one device
    and fsdp 2 x data 2 give the same step byte for byte. Negative control: the reference kernels give other
    bits. Under default numerics a multi-device mesh with the Pallas kernels is refused."""
    from detjax.sharding.mesh import build_layout

    canon = ["determinism.numerics=canonical", "determinism.canonical_leaf=2", *PALLAS]
    ref = _one_step(canon + ["mesh.devices=1"], model)
    got = _one_step(canon + ["mesh.devices=4", "mesh.data=2", "mesh.fsdp=2"], model)
    assert _same(got[0], ref[0]) and _same(got[1]["digest"], ref[1]["digest"])
    other = _one_step([*canon, "model.kernels=reference", "mesh.devices=1"], model)
    assert not _same(other[1]["digest"], ref[1]["digest"]), "negative control: other kernels, other bits"
    cfg = load_config(MESH_CFG, [*PALLAS, "mesh.devices=4", "mesh.data=4"])
    with pytest.raises(ConfigError, match=r"model\.kernels.*determinism\.numerics=canonical"):
        build_layout(cfg, jax.devices()[:4])


@pytest.mark.extended  # ~1 min on 2 cores; the one-step test above covers the same trees in the default run
def test_resume_on_another_mesh_continues_the_trajectory(tmp_path):
    """Canonical: train on dp8, stop after step 1 (a checkpoint at an odd step), resume on fsdp 2 x expert 4
    (the experts' weights and optimizer state resharded) and continue: fingerprints and final parameters
    byte-equal to the uninterrupted dp8 run. Under default numerics the same resume is refused (the mesh is
    part of the trajectory there)."""
    from detjax.ckpt import CheckpointError
    from detjax.train import train

    base = ["model.pattern='E-'", "model.mtp.depth=0", "train.steps=3", "ckpt.every=1", "run.save_final_params=true"]
    canon = base + ["determinism.numerics=canonical"]
    ref = train(load_config(MESH_CFG, canon + ["mesh.data=8"]), tmp_path / "ref")
    train(load_config(MESH_CFG, canon + ["mesh.data=8", "run.stop_after=1"]), tmp_path / "moved")
    moved = ["mesh.fsdp=2", "mesh.expert=4", "mesh.data=1"]
    got = train(load_config(MESH_CFG, canon + moved), tmp_path / "moved", resume=True)
    assert (got.run_dir / "fingerprints.jsonl").read_bytes() == (ref.run_dir / "fingerprints.jsonl").read_bytes()
    a, b = np.load(ref.run_dir / "final_params.npz"), np.load(got.run_dir / "final_params.npz")
    for k in a:
        np.testing.assert_array_equal(a[k].view(np.uint32), b[k].view(np.uint32), err_msg=k)
    train(load_config(MESH_CFG, base + ["mesh.data=8", "run.stop_after=1"]), tmp_path / "default")
    with pytest.raises(CheckpointError):
        train(load_config(MESH_CFG, base + ["mesh.fsdp=8", "mesh.data=1"]), tmp_path / "default", resume=True)


@pytest.mark.extended  # ~2 min on 2 cores
def test_resume_onto_a_pipeline_continues_the_trajectory(tmp_path):
    """Canonical, MoE + MLP with MTP: train on dp8, stop after step 1, resume on pp2 x expert 2 x data 2 (one
    leaf per microbatch; the state's one-device layout resharded, the stage copy stacked inside the step) and
    continue: fingerprints and final parameters byte-equal to the uninterrupted dp8 run. Negative control: the
    same resume with one restored parameter element nudged by one ulp gives other fingerprints."""
    base = ["model.pattern='E-E-'", "train.steps=3", "ckpt.every=1", "run.save_final_params=true"]
    canon = base + ["determinism.numerics=canonical"]
    pp = ["mesh.pipeline=2", "mesh.expert=2", "mesh.data=2", "train.micro_batch=1"]
    _resume_moved(tmp_path, canon, ["mesh.data=8"], ["mesh.data=8"], pp)


@pytest.mark.extended  # ~4 min on 2 cores
def test_resume_onto_tensor_parallelism_continues_the_trajectory(tmp_path):
    """Canonical with 8 feature chunks, tiny_mesh's hybrid (M*E- and MTP): train on dp8, stop after step 1 (a
    checkpoint at an odd step), resume on tp2 x ep2 x data 2 (the state resharded over `tensor`) and continue:
    fingerprints and final parameters byte-equal to the uninterrupted one-device run. Negative control: the
    same resume with one restored parameter element nudged by one ulp gives other fingerprints."""
    canon = [*TP, "train.steps=3", "ckpt.every=1", "run.save_final_params=true"]
    _resume_moved(
        tmp_path, canon, ["mesh.devices=1"], ["mesh.data=8"], ["mesh.tensor=2", "mesh.expert=2", "mesh.data=2"]
    )


@pytest.mark.extended  # ~2 min on 2 cores
def test_resume_onto_expert_dispatch_continues_the_trajectory(tmp_path):
    """Canonical with the Pallas grouped matmuls and 2 feature chunks: train on dp8, stop after step 1, resume on
    tensor 2 x expert 2 x data 2, where the experts' tokens are dispatched (each device restores only its
    experts' weights and optimizer state) and continue: fingerprints and final parameters byte-equal to the
    uninterrupted one-device run. Negative control: a restored parameter nudged by one ulp."""
    canon = [*EP, "determinism.max_tensor=2", "train.steps=3", "ckpt.every=1", "run.save_final_params=true"]
    _resume_moved(
        tmp_path, canon, ["mesh.devices=1"], ["mesh.data=8"], ["mesh.tensor=2", "mesh.expert=2", "mesh.data=2"]
    )


def _resume_moved(tmp_path, canon: list[str], ref_mesh: list[str], first_mesh: list[str], then_mesh: list[str]):
    """The uninterrupted run on ref_mesh against one stopped after step 1 on first_mesh and resumed on
    then_mesh: fingerprints and final parameters byte-equal. Negative control: the same resume with one restored
    parameter element nudged by one ulp gives other fingerprints."""
    import shutil

    from detjax.train import train

    ref = train(load_config(MESH_CFG, canon + ref_mesh), tmp_path / "ref")
    train(load_config(MESH_CFG, canon + first_mesh + ["run.stop_after=1"]), tmp_path / "moved")
    shutil.copytree(tmp_path / "moved", tmp_path / "nudged")
    got = train(load_config(MESH_CFG, canon + then_mesh), tmp_path / "moved", resume=True)
    want = (ref.run_dir / "fingerprints.jsonl").read_bytes()
    assert (got.run_dir / "fingerprints.jsonl").read_bytes() == want
    a, b = np.load(ref.run_dir / "final_params.npz"), np.load(got.run_dir / "final_params.npz")
    for k in a:
        np.testing.assert_array_equal(a[k].view(np.uint32), b[k].view(np.uint32), err_msg=k)

    def nudge(state, batches):
        leaves, tree = jax.tree.flatten(state.params)
        leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nextafter(leaves[0].ravel()[0], jnp.inf))
        return state.replace(params=jax.tree.unflatten(tree, leaves)), batches

    nudged = train(load_config(MESH_CFG, canon + then_mesh), tmp_path / "nudged", resume=True, after_restore=nudge)
    assert (nudged.run_dir / "fingerprints.jsonl").read_bytes() != want, "negative control: one ulp should show"


def test_pinned_adamw_is_optax_adamw_with_rounded_products():
    """The canonical optimizer keeps optax.adamw's state pytree (checkpoints interchangeable) and its math
    (equal to float32 rounding over five steps with weight decay on matrices only), and its update passes each
    product through an integer xor with a zero behind an optimization barrier (optim.rounded), which keeps
    XLA from contracting a product into an FMA; optax's has neither."""
    import optax

    from detjax.config import TrainConfig
    from detjax.optim import _decay_mask, lr_schedule, pinned_adamw

    t = TrainConfig(steps=10, warmup_steps=2, lr=1e-2)
    ref = optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=_decay_mask)
    pin = pinned_adamw(t)
    p = {"w": jax.random.normal(jax.random.key(0), (4, 3)), "b": jnp.ones(3)}
    sr, sp, pr, pp = ref.init(p), pin.init(p), p, p
    assert jax.tree.structure(sr) == jax.tree.structure(sp)
    for i in range(5):
        g = jax.tree.map(lambda x, i=i: jax.random.normal(jax.random.key(i + 1), x.shape), p)
        ur, sr = ref.update(g, sr, pr)
        up, sp = jax.jit(pin.update)(g, sp, pp)
        pr, pp = optax.apply_updates(pr, ur), optax.apply_updates(pp, up)
    for a, b in zip(jax.tree.leaves((pr, sr)), jax.tree.leaves((pp, sp)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    pinned, plain = (jax.jit(tx.update).lower(g, st, q).as_text() for tx, st, q in ((pin, sp, pp), (ref, sr, pr)))
    # one xor per product that feeds an add: six for the decayed matrix, five for the vector (no decay)
    assert pinned.count("optimization_barrier") == 1 and pinned.count("stablehlo.xor") == 6 + 5
    compiled = jax.jit(pin.update).lower(g, sp, pp).compile().as_text()  # XLA did not fold the xors away
    assert "u32[4,3]{1,0} xor(" in compiled and "u32[3]{0} xor(" in compiled
    assert "optimization_barrier" not in plain and "stablehlo.xor" not in plain  # control


def test_pinned_adamw_rounds_as_optimization_barriers_would():
    """optim.rounded gives each product the bits an optimization barrier between product and add gives it (the
    rule before it, kept here as the oracle): params, mu and nu byte-equal over four steps, with and without
    weight decay, stacked small leaves included. Negative control: another eps gives other bits."""
    import optax

    from detjax.config import TrainConfig
    from detjax.optim import _decay_mask, lr_schedule, pinned_adamw

    t = TrainConfig(steps=10, warmup_steps=1, lr=1e-2, weight_decay=0.1)

    def barrier_rule(t):  # every product that feeds an add through its own optimization barrier
        schedule, b1, b2, eps, wd = lr_schedule(t), t.b1, t.b2, t.eps, t.weight_decay
        apart = jax.lax.optimization_barrier

        def update(grads, state, params):
            adam, masked, sched = state
            count = optax.safe_increment(adam.count)
            c1 = (1 - jnp.asarray(b1, jnp.float32) ** count).astype(jnp.float32)
            c2 = (1 - jnp.asarray(b2, jnp.float32) ** count).astype(jnp.float32)
            step = -schedule(sched.count)

            def leaf(g, m, v, p, d):
                mu = apart((1 - b1) * g) + apart(b1 * m)
                nu = apart((1 - b2) * (g * g)) + apart(b2 * v)
                u = (mu / c1) / (jnp.sqrt(nu / c2) + eps)
                u = u + apart(wd * p) if d else u
                return mu, nu, apart(u * step)

            out = jax.tree.map(leaf, grads, adam.mu, adam.nu, params, _decay_mask(params))
            pick = [jax.tree.map(lambda o, k=k: o[k], out, is_leaf=lambda o: isinstance(o, tuple)) for k in range(3)]
            new = (adam._replace(count=count, mu=pick[0], nu=pick[1]), masked, sched._replace(count=sched.count + 1))
            return pick[2], new

        return update

    def run(update, init):
        keys = iter(jax.random.split(jax.random.key(11), 16))
        p = {"w": jax.random.normal(next(keys), (16, 12)), "b": jax.random.normal(next(keys), (12,))}
        st = init(p)
        for _ in range(4):
            g = jax.tree.map(lambda x: 1e-2 * jax.random.normal(next(keys), x.shape), p)
            u, st = jax.jit(update)(g, st, p)
            p = jax.jit(optax.apply_updates)(p, u)
        return p, st[0].mu, st[0].nu

    pin = pinned_adamw(t)
    want = run(barrier_rule(t), pin.init)
    assert _same(run(pin.update, pin.init), want)
    other = TrainConfig(steps=10, warmup_steps=1, lr=1e-2, weight_decay=0.1, eps=2e-8)
    assert not _same(run(pinned_adamw(other).update, pin.init)[0], want[0]), "negative control: another eps"


def test_stacked_optimizer_and_square_sums_give_the_per_leaf_bits():
    """The canonical optimizer and square sums stack small leaves of one shape and key (the logical sharding;
    canonical.STACK_BYTES): the same bits as one leaf at a time, for leaves that stack and leaves that do not.
    Leaves with other keys never share a stack. Negative control: another learning rate gives other bits."""
    from detjax.config import TrainConfig
    from detjax.optim import clip_by_canonical_norm, pinned_adamw

    keys = iter(jax.random.split(jax.random.key(3), 32))
    shapes = [(8,), (8,), (4, 6), (8,), (4, 6), (96, 64), (3,), (8,)]  # (96, 64): 24 KiB
    specs = ["a", "a", "a", "a", "a", "a", "a", "b"]  # the last (8,) is sharded otherwise
    params = {f"p{i}": jax.random.normal(next(keys), s) for i, s in enumerate(shapes)}
    grads = [{k: jax.random.normal(next(keys), v.shape) * 1e-2 for k, v in params.items()} for _ in range(3)]
    leaves = jax.tree.leaves(params)
    assert [len(g) for g in canonical.stack_groups(leaves, specs, 1024)] == [3, 2, 1, 1, 1]
    assert all(len(g) == 1 for g in canonical.stack_groups(leaves, None, 1 << 20))

    def run(keys, limit=1 << 20, lr=1e-2):
        old = canonical.STACK_BYTES
        canonical.STACK_BYTES = limit
        try:
            t = TrainConfig(steps=10, warmup_steps=1, lr=lr, weight_decay=0.1, clip_norm=0.05)
            tx = optax.chain(clip_by_canonical_norm(t.clip_norm, keys), pinned_adamw(t, keys))
            p, st = params, tx.init(params)
            for g in grads:
                u, st = jax.jit(tx.update)(g, st, p)
                p = jax.tree.map(jnp.add, p, u)
            return p, st, jax.jit(lambda g: canonical.square_sums(g, keys))(grads[0])
        finally:
            canonical.STACK_BYTES = old

    alone = run(None)
    assert _same(run(specs, 1024), alone) and _same(run(specs), alone)
    assert not _same(run(specs, lr=2e-2)[0], alone[0]), "negative control: another step size, other bits"


@pytest.mark.slow
@pytest.mark.extended  # three training processes (~3 min on 2 cores); run with -m extended
def test_two_processes_equal_one_device(tmp_path, python):
    """Canonical, hybrid M*E-M*E-: dp8 over 2 processes x 4 CPU devices (jax.distributed, gloo) gives the
    fingerprints of the one-device run byte for byte; under default numerics the two differ (the negative
    control: there the batch split is part of the numerics)."""
    import subprocess

    from test_mesh import _free_port

    run = [python, "-m", "detjax.train", "--config", MESH_CFG, "run.progress=false", "ckpt.enabled=false"]
    run += ["model.pattern='M*E-M*E-'", "train.steps=3"]

    def env(n_dev: int) -> dict:
        e = dict(os.environ, JAX_PLATFORMS="cpu")
        keep = [f for f in e.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device")]
        e["XLA_FLAGS"] = " ".join([*keep, f"--xla_force_host_platform_device_count={n_dev}"])
        return e

    def one(name: str, *extra: str) -> bytes:
        p = subprocess.run(
            [*run, "--run-dir", str(tmp_path / name), *extra], env=env(8), capture_output=True, text=True
        )
        assert p.returncode == 0, p.stdout + p.stderr
        return (tmp_path / name / "fingerprints.jsonl").read_bytes()

    canon = "determinism.numerics=canonical"
    port = _free_port()
    dist = [f"dist.coordinator=127.0.0.1:{port}", "dist.num_processes=2", "mesh.data=8", "mesh.devices=0", canon]
    procs = [
        subprocess.Popen(
            [*run, "--run-dir", str(tmp_path / "two"), *dist, f"dist.process_id={i}"],
            env=env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    for i, p in enumerate(procs):
        log = p.communicate(timeout=900)[0]
        assert p.returncode == 0, f"process {i}:\n{log}"
    two = (tmp_path / "two" / "fingerprints.jsonl").read_bytes()
    assert len(two.splitlines()) == 3
    assert two == one("single", "mesh.devices=1", canon)
    assert one("default", "mesh.devices=1") != one("default_dp8", "mesh.data=8"), "negative control"
