"""model.fp8: fp8 projections with delayed scaling (emulated with JAX's float8 dtypes on the CPU). The scales
and amax histories live in TrainState.collections: two runs give the same bytes (L1), a resumed run equals the
uninterrupted one with the scales and histories included (L2), the scale of step s comes from the amaxes of
steps < s, and a changed saved scale is refused on restore. Byte equality throughout."""

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detjax import loss
from detjax.ckpt import Checkpointer, CheckpointError
from detjax.ckpt.manager import host_bytes
from detjax.config import ConfigError, load_config
from detjax.model import fp8
from detjax.pallas_kernels.matmul.kernel import matmul_kernel
from detjax.sharding.mesh import replicated, single_device_mesh
from detjax.step import Trainer
from detjax.train import train

STEPS = 4
BASE = ["model.fp8.enabled=true", "model.fp8.amax_history_len=3", f"train.steps={STEPS}", "train.warmup_steps=2"]
# fp8 products of every kind but Mamba2's (the same proj() path) in two blocks: routed experts + shared expert (MLP),
# and the MTP projection with an attention block
BASE += ["model.pattern='E'", "model.mtp.pattern='*'"]
BASE += ["run.progress=false", "run.log_every=0", "ckpt.every=1", f"ckpt.keep={STEPS + 1}"]


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _same(a, b) -> bool:
    return np.asarray(a).shape == np.asarray(b).shape and np.array_equal(_bits(a), _bits(b))


@pytest.fixture(scope="module")
def cfg_of(tiny_path):
    return lambda *extra: load_config(tiny_path, BASE + list(extra))


@pytest.fixture(scope="module")
def reference(cfg_of, tmp_path_factory):
    return train(cfg_of(), tmp_path_factory.mktemp("fp8") / "run")


def _restore(run_dir, cfg, step):
    trainer = Trainer(cfg)
    abstract = trainer.abstract_state()
    ck = Checkpointer(run_dir / "checkpoints", cfg)
    try:
        return ck.restore(abstract, jax.tree.map(lambda _: replicated(single_device_mesh()), abstract), step)[0]
    finally:
        ck.close()


def test_fp8_matmul_uses_the_given_scales_and_returns_the_amaxes():
    """Forward and both gradients close to the bf16 product; the cotangent of the scales is (max|x|, max|w|,
    max|dy|) exactly; the product depends on the scales passed in (delayed), and the Pallas kernel path (CPU
    interpreter) gives the same values as XLA's dot on the same fp8 operands up to summation order."""
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (48, 64)).astype(jnp.bfloat16)
    w = 0.1 * jax.random.normal(ks[1], (64, 40))
    g = jax.random.normal(ks[2], (48, 40))
    s = jnp.asarray([100.0, 1000.0, 5000.0], jnp.float32)  # no clipping: |x|, |w|, |g| below fmax / s

    def loss(x, w, s, kernels="reference"):
        return jnp.sum(fp8.fp8_matmul(x, w, s, jnp.float32, kernels) * g)

    want = jnp.dot(x.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32))
    y = fp8.fp8_matmul(x, w, s, jnp.float32, "reference")
    assert float(jnp.max(jnp.abs(y - want)) / jnp.max(jnp.abs(want))) < 0.08
    dx, dw, amax = jax.grad(loss, argnums=(0, 1, 2))(x, w, s)
    # dy in e5m2 (2 mantissa bits): gradients within ~1/4 of the largest entry
    assert float(jnp.max(jnp.abs(dx.astype(jnp.float32) - g @ w.T)) / jnp.max(jnp.abs(g @ w.T))) < 0.25
    ref_dw = x.astype(jnp.float32).T @ g
    assert float(jnp.max(jnp.abs(dw - ref_dw)) / jnp.max(jnp.abs(ref_dw))) < 0.25
    want_amax = [jnp.max(jnp.abs(x.astype(jnp.float32))), jnp.max(jnp.abs(w)), jnp.max(jnp.abs(g))]
    assert _same(amax, jnp.stack(want_amax))
    assert not _same(fp8.fp8_matmul(x, w, s * 2, jnp.float32, "reference"), y)  # the scales are used
    # the Pallas kernel (interpreted on the CPU, Triton on the GPU) against float32 sums of the same fp8 values
    x8, w8 = (fp8._quantize(v, sv, fp8.E4M3).astype(jnp.float32) for v, sv in ((x, s[0]), (w, s[1])))
    exact = jnp.dot(x8, w8, precision=jax.lax.Precision.HIGHEST) / (s[0] * s[1])
    for kernels in ("reference", "pallas") if jax.default_backend() == "cpu" else ("pallas",):
        got = fp8.fp8_matmul(x, w, s, jnp.float32, kernels)
        rel = float(jnp.max(jnp.abs(got - exact))) / float(jnp.max(jnp.abs(exact)))
        assert rel <= 1e-5, (kernels, rel)
    g8 = fp8._quantize(g, s[2], fp8.E5M2).astype(jnp.float32)
    dw_exact = jnp.dot(x8.T, g8, precision=jax.lax.Precision.HIGHEST) / (s[0] * s[2])
    dwp = jax.grad(loss, argnums=1)(x, w, s, "pallas")  # e5m2 x e4m3 products (bf16 MMAs in the kernel)
    assert float(jnp.max(jnp.abs(dwp - dw_exact))) <= 1e-5 * float(jnp.max(jnp.abs(dw_exact)))
    with pytest.raises(ValueError, match="share a dtype"):
        matmul_kernel(x, w.astype(jnp.float8_e4m3fn), kind="fwd", out_dtype=jnp.float32, interpret=True)


def test_fp8_grouped_matmul_kernel_and_reference_agree():
    """The experts' fp8 gmm: the Pallas gmm / tgmm (interpreted) and XLA's ragged_dot reference multiply the same
    fp8 values (equal up to summation order), and the scales' cotangent is the three amaxes."""
    ks = jax.random.split(jax.random.key(1), 3)
    gs = jnp.asarray([5, 0, 19, 8], jnp.int32)
    x = jax.random.normal(ks[0], (32, 16)).astype(jnp.bfloat16)
    w = 0.1 * jax.random.normal(ks[1], (4, 16, 32))
    g = jax.random.normal(ks[2], (32, 32))
    s = jnp.asarray([100.0, 1000.0, 5000.0], jnp.float32)
    outs = {}
    for kernels in ("reference", "pallas"):
        f = lambda x, w, s, kernels=kernels: jnp.sum(fp8.fp8_grouped_matmul(x, w, gs, s, kernels, x.dtype) * g)  # noqa: E731
        outs[kernels] = (
            fp8.fp8_grouped_matmul(x, w, gs, s, kernels, x.dtype),
            *jax.grad(f, argnums=(0, 1, 2))(x, w, s),
        )
    for a, b in zip(outs["reference"], outs["pallas"], strict=True):
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        assert float(jnp.max(jnp.abs(a32 - b32))) <= 1e-5 * float(jnp.max(jnp.abs(a32))) + 1e-6
    amax = outs["pallas"][3]
    assert _same(amax, jnp.stack([jnp.max(jnp.abs(x.astype(jnp.float32))), jnp.max(jnp.abs(w)), jnp.max(jnp.abs(g))]))
    assert not np.any(np.asarray(outs["pallas"][2][1]))  # the empty group's weight gradient is zero


def test_fp8_grouped_mosaic_path_is_exact_on_its_padded_layout():
    """The experts' fp8 products through the Mosaic kernel (fp8 wgmma on Hopper; its interpreter here) on the
    padded group layout (gmm/mosaic.py): an empty group, a group over two row tiles (dw over four 128-row
    blocks) and one inside a tile. On small integers every sum is exact, so y, dx and dw are byte-equal to
    XLA's ragged_dot reference, and the amaxes too. Negative control: swapped group sizes change y."""
    ks = jax.random.split(jax.random.key(3), 3)
    gs = jnp.asarray([0, 300, 90], jnp.int32)
    ints = lambda k, shape: jax.random.randint(k, shape, -3, 4).astype(jnp.float32)  # noqa: E731
    x, w, g = ints(ks[0], (390, 256)).astype(jnp.bfloat16), ints(ks[1], (3, 256, 128)), ints(ks[2], (390, 128))
    s = jnp.ones((3,), jnp.float32)

    def run(kernels, gs=gs):
        y, vjp = jax.vjp(lambda x, w, s: fp8.fp8_grouped_matmul(x, w, gs, s, kernels, x.dtype), x, w, s)
        return y, *vjp(g)

    ref, got = run("reference"), run("mosaic")
    for name, a, b in zip(("y", "dx", "dw", "amax"), ref, got, strict=True):
        assert _same(a, b), name
    wq = fp8.grouped_weight_copy(w, s, "mosaic")  # the step's once-per-step copy (Trainer.compute_copies)
    y, vjp = jax.vjp(lambda x, w, s: fp8.fp8_grouped_matmul_copy(x, w, gs, s, wq, "mosaic", x.dtype), x, w, s)
    for name, a, b in zip(("y", "dx", "dw", "amax"), got, (y, *vjp(g)), strict=True):
        assert _same(a, b), f"{name} from the copy"
    assert float(jnp.max(jnp.abs(got[2][1]))) > 0 and not np.any(np.asarray(got[2][0]))  # group 0 is empty
    assert not _same(run("reference", gs[::-1])[0], got[0])


@pytest.mark.gpu
def test_fp8_grouped_mosaic_is_row_and_group_invariant_and_replays_on_gpu():
    """On Hopper, the experts' fp8 wgmma path on general values (sums that round): replays give the same bits,
    and 100 rows added in front of expert 0's group change no other row's y or dx and no other expert's dw
    (each group's dw sums its own rows in its own order, wherever the layout puts them). Negative control:
    expert 0's dw changes."""
    from detjax.pallas_kernels.harness import assert_replays_bit_exact

    e, k, n = 8, 1024, 1024
    w = 0.02 * jax.random.normal(jax.random.key(1), (e, k, n))
    if not fp8._grouped_mosaic(w, "pallas"):
        pytest.skip("the grouped fp8 Mosaic path needs a Hopper GPU")
    gs = jnp.asarray([900, 1100, 0, 1500, 1024, 700, 1300, 1668], jnp.int32)
    rows = int(gs.sum())
    x = jax.random.normal(jax.random.key(2), (rows + 100, k)).astype(jnp.bfloat16)
    g = jax.random.normal(jax.random.key(3), (rows + 100, n))
    s = jnp.asarray([8.0, 64.0, 4096.0], jnp.float32)

    @jax.jit
    def run(x, w, g, gs):
        y, vjp = jax.vjp(lambda x, w: fp8.fp8_grouped_matmul(x, w, gs, s, "pallas", jnp.bfloat16), x, w)
        return y, *vjp(g)

    base = run(x[100:], w, g[100:], gs)
    assert_replays_bit_exact(run, (x[100:], w, g[100:], gs), replays=3)
    grown = run(x, w, g, gs.at[0].add(100))
    assert _same(grown[0][100:], base[0]) and _same(grown[1][100:], base[1])
    assert _same(grown[2][1:], base[2][1:])
    assert not _same(grown[2][0], base[2][0])


def test_step_amax_is_the_microbatches_maximum(tiny_path):
    """Trainer.grad_sums' amaxes (a running maximum in the microbatch loop's carry) are byte-equal to the maximum
    over the microbatches' own amaxes, each microbatch's taken alone from micro_objective's gradient with respect
    to the scales. The two microbatches' amaxes differ, so neither one microbatch's amax nor their sum would
    pass (checked)."""
    over = ["model.fp8.enabled=true", "model.pattern='*-'", "model.mtp.depth=0", "model.dropout=0"]
    cfg = load_config(tiny_path, [*over, "train.global_batch=4", "train.micro_batch=2", "train.seq_len=16"])
    trainer = Trainer(cfg)
    state = jax.jit(trainer.init_state)(jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (4, 17), 0, cfg.model.vocab_size)
    micro, key = trainer.micro_tokens(batch), jax.random.key(5)
    _, _, amax = jax.jit(trainer.grad_sums)(state, micro, key)
    grad = jax.jit(jax.grad(trainer.micro_objective, argnums=3, has_aux=True))
    scales = trainer.fp8_scales(state)
    each = [grad(state.params, micro[i], jax.random.fold_in(key, i), scales)[0] for i in range(micro.shape[0])]
    want = jax.tree.map(jnp.maximum, *each)
    for a, b in zip(jax.tree.leaves(amax), jax.tree.leaves(want), strict=True):
        assert _same(a, b)
    firsts, lasts = jax.tree.leaves(each[0]), jax.tree.leaves(each[1])
    assert any(not _same(a, b) for a, b in zip(jax.tree.leaves(amax), firsts, strict=True))
    assert any(not _same(a, b) for a, b in zip(jax.tree.leaves(amax), lasts, strict=True))
    sums = jax.tree.leaves(jax.tree.map(jnp.add, *each))
    assert any(not _same(a, b) for a, b in zip(jax.tree.leaves(amax), sums, strict=True))


def _fp8_microbatch_loop(tiny_path, pattern: str):
    """The fp8 train step's microbatch loop, traced (kernels strategy, fp8 head): (its scan equation, the
    equations of its body, nested ones included, Pallas kernels' own bodies skipped). The loop is the scan with
    the largest body: interpreted kernels add small scans of their own."""
    from detjax.jaxprs import iter_eqns

    over = [f"model.pattern={pattern}", "model.mtp.depth=0", "model.kernels=pallas", "determinism.strategy=kernels"]
    cfg = load_config(tiny_path, [*over, "model.fp8.enabled=true", "model.fp8.lm_head=true"])
    trainer = Trainer(cfg)
    state = jax.eval_shape(trainer.init_state, jax.random.key(0))
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len + 1), jnp.int32)
    step = jax.make_jaxpr(trainer.train_step)(state, batch)
    scans = [e for e in iter_eqns(step, skip=("pallas_call",)) if e.primitive.name == "scan"]
    loop = max(scans, key=lambda e: len(e.params["jaxpr"].jaxpr.eqns))
    return loop, list(iter_eqns(loop.params["jaxpr"], skip=("pallas_call",)))


def test_microbatch_loop_has_no_per_microbatch_scale_work(tiny_path):
    """With the step's weight copies (model.kernels=pallas), the microbatch loop holds no scalar division: each
    product's dequantizing factors come with its weight copy, made once per step (fp8.dequant_factors). The
    loop stacks no outputs: the amaxes' maximum is carried (Trainer.accumulate). On the GPU each of these was
    a small kernel per product and microbatch. Checked in the jaxpr, so the same on every backend; 1e87047's
    step had 30 scalar divisions in this loop and stacked the amaxes."""
    loop, body = _fp8_microbatch_loop(tiny_path, "'*-E'")
    assert any(e.primitive.name == "pallas_call" for e in body)  # the products are in the loop
    assert not [e for e in body if e.primitive.name == "div" and e.outvars[0].aval.shape == ()]
    stacked = [v for v in loop.outvars if v.aval.shape == (loop.params["length"], 3)]
    assert not stacked  # no (microbatches, 3) stack of the amaxes


def test_mosaic_loop_slices_no_scale_set(tiny_path, monkeypatch):
    """On the Mosaic path (forced here: it is traced, not run) the microbatch loop slices no projection's scale
    set (s_x, s_w, s_g): each quantization kernel reads its element itself (quantize.scale_input). On the GPU
    XLA emits such a slice as a device-to-device copy, one per quantization and microbatch: 512 a step in
    gpu_dense's fp8 profile, where 1804275's step sliced 20 times in this loop (docs/benchmarks-history.md
    set 35). And it reduces the amaxes once per scale set (below). Checked in the jaxpr."""
    from detjax.pallas_kernels.matmul import kernel

    monkeypatch.setattr(kernel, "use_mosaic_fp8", lambda *a: True)
    _, body = _fp8_microbatch_loop(tiny_path, "'*-'")
    assert sum(e.primitive.name == "pallas_call" for e in body) >= 10  # the quantizations and products
    sliced = [
        e for e in body if e.primitive.name in ("slice", "dynamic_slice", "gather") and e.invars[0].aval.shape == (3,)
    ]
    assert not sliced, [str(e) for e in sliced]
    # the quantization kernels' per-tile amaxes are reduced once per scale set, in the product's backward
    # (quantize.amax_of): no reduction of a kernel's tile grid of its own. 65e9705's loop had 10 such
    # reductions here, each a kernel launch on the GPU, and 5 after this change (one per projection's scale set)
    whole = [e for e in body if e.primitive.name == "reduce_max" and e.params["axes"] == (0, 1)]
    sets = [e for e in body if e.primitive.name == "reduce_max" and e.invars[0].aval.shape[0] == 3]
    assert not whole and len(sets) == 5, ([str(e.invars[0].aval) for e in whole], len(sets))


def _copies_case(tiny_path, overrides):
    """A one-microbatch fp8 setup for the compute-copies tests: (trainer, state, scales, copies_of, grads), with
    copies_of(scales) the step's copies and grads(compute) the microbatch's loss terms, gradients and amaxes
    (compute None: the weights quantized at each use)."""
    base = ["model.kernels=pallas", "model.fp8.enabled=true", "train.global_batch=2", "train.micro_batch=2"]
    cfg = load_config(tiny_path, [*base, "model.mtp.depth=0", "model.dropout=0", "run.tensorboard=false", *overrides])
    trainer = Trainer(cfg)
    state = jax.jit(trainer.init_state)(jax.random.key(0))
    scales = jax.tree.map(lambda s: s * jnp.asarray([4.0, 16.0, 2.0]), trainer.fp8_scales(state))
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.train.seq_len + 1), 0, cfg.model.vocab_size)

    @jax.jit
    def grads(compute):
        grad = jax.grad(trainer.micro_objective, argnums=(0, 3), has_aux=True)
        return grad(state.params, tokens, jax.random.key(2), scales, compute=compute)

    def copies_of(scales):
        return jax.jit(trainer.compute_copies)(state.params, scales)

    return trainer, state, scales, copies_of, grads


def _assert_copies_exact(grads, compute):
    """The loss terms, gradients and amaxes read from the copies, byte-equal to quantizing at each use."""
    ref, got = jax.device_get(grads(None)), jax.device_get(grads(compute))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        assert _same(a, b)
    return ref


def test_fp8_compute_copies_give_the_same_bits(tiny_path):
    """model.fp8 with model.kernels=pallas: the step quantizes each fp8 projection's weight once, before the
    microbatch loop (Trainer.compute_copies: fp8.weight_copy with the step's scales, the routed experts'
    stacks by fp8.grouped_weight_copy; the LM head's copy stays in the compute dtype unless model.fp8.lm_head).
    The loss, every gradient and every amax are byte-equal to quantizing at each use, and the products read
    the copies (negative controls: copies made with other scales change the loss, the experts' alone too)."""
    _, _, scales, copies_of, grads = _copies_case(tiny_path, ["model.pattern='M*E'", "train.seq_len=32"])
    compute = copies_of(scales)
    assert compute["w_head"].dtype == jnp.bfloat16
    for group in (
        ["layer_0", "mixer", "w_in_z+w_in_x+w_in_bc+w_in_dt"],
        ["layer_1", "mixer", "w_q+w_k+w_v"],
        ["layer_2", "mixer", "shared", "w_gate+w_up"],
        ["layer_2", "mixer", "shared", "w_down"],
        ["layer_2", "mixer", "experts", "w_gate"],
        ["layer_2", "mixer", "experts", "w_down"],
    ):
        copy = functools.reduce(lambda t, k: t[k], group, compute)
        assert copy[0].dtype == fp8.E4M3 and copy[2].shape == (), group
    ref = _assert_copies_exact(grads, compute)
    other = copies_of(jax.tree.map(lambda s: s * 2.0, scales))
    assert not _same(grads(other)[1][0], ref[1][0])
    mixer = compute["layer_2"]["mixer"]  # the experts' copies alone from other scales: they are read too
    experts_only = {**compute, "layer_2": {"mixer": {**mixer, "experts": other["layer_2"]["mixer"]["experts"]}}}
    assert not _same(grads(experts_only)[1][0], ref[1][0])


def test_fp8_lm_head_shares_one_scale_set_between_the_lm_and_mtp_heads(tiny_path):
    """model.fp8.lm_head: the LM head and the MTP head (one weight) run in fp8 with one scale set, "head",
    whose amaxes are the maximum over the two uses (tensor.max_copies; a sum would give 2 max |w| for the
    weight's). The step's fp8 copy of w_head is read by both heads: loss, gradients and amaxes byte-equal to
    quantizing at each use. Negative control: a copy of the head alone made with other scales changes the
    loss."""
    over = ["model.pattern='*-'", "train.seq_len=16", "model.mtp.depth=1", "model.fp8.lm_head=true"]
    trainer, state, scales, copies_of, grads = _copies_case(tiny_path, over)
    assert "head" in scales and "head" in trainer.fp8_scales(state)
    compute = copies_of(scales)
    assert compute["w_head"][0].dtype == fp8.E4M3
    ref = _assert_copies_exact(grads, compute)
    amax = ref[0][1]["head"]
    assert _same(amax[1], jnp.max(jnp.abs(state.params["w_head"]))), "the weight's amax: a max over the uses"
    head_only = {**compute, "w_head": copies_of(jax.tree.map(lambda s: s * 2.0, scales))["w_head"]}
    assert not _same(grads(head_only)[1][0], ref[1][0])


def test_fp8_lm_head_config(tiny_path):
    """model.fp8.lm_head: refused without fp8 and with a vocabulary-chunked head (determinism.max_tensor > 1);
    off, it is left out of the config hash, so configs saved before it existed keep theirs; on, it changes
    the hash."""
    from detjax.config import config_from_dict

    with pytest.raises(ConfigError, match=r"'model.fp8.lm_head'.*Fix: enable fp8"):
        load_config(tiny_path, ["model.fp8.lm_head=true"])
    canon = ["determinism.numerics=canonical", "determinism.max_tensor=2", "model.fp8.enabled=true"]
    with pytest.raises(ConfigError, match=r"'model.fp8.lm_head'.*max_tensor > 1.*Fix: set model.fp8.lm_head=false"):
        load_config(tiny_path, [*canon, "model.fp8.lm_head=true"])
    load_config(tiny_path, canon)  # control
    cfg = load_config(tiny_path, ["model.fp8.enabled=true"])
    older = cfg.to_dict()
    del older["model"]["fp8"]["lm_head"]
    assert config_from_dict(older).hash() == cfg.hash()
    assert load_config(tiny_path, ["model.fp8.enabled=true", "model.fp8.lm_head=true"]).hash() != cfg.hash()


@pytest.mark.gpu
def test_fp8_mosaic_compute_copies_give_the_same_bits_on_gpu(tiny_path):
    """On Hopper, the Mosaic path's weight copies (padded fp8 copies in both layouts; the fused SwiGLU MLP
    reads two): loss, gradients and amaxes byte-equal to quantizing at each use, at gpu_dense's widths."""
    dims = ["model.d_model=1024", "model.ffn_dim=2048", "model.n_heads=16", "model.n_kv_heads=4", "model.head_dim=64"]
    _, state, scales, copies_of, grads = _copies_case(tiny_path, ["model.pattern='*-'", "train.seq_len=256", *dims])
    if not fp8._mosaic_path(state.params["layer_1"]["mixer"]["w_down"], "pallas"):
        pytest.skip("the Mosaic fp8 path needs a Hopper GPU")
    compute = copies_of(scales)
    assert compute["layer_1"]["mixer"]["w_down"][1] is not None  # the transposed copy: the Mosaic path's
    _assert_copies_exact(grads, compute)


def test_delayed_scaling_update_rule():
    hist = jnp.asarray([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [4.0, 8.0, 1.0]], jnp.float32)
    old = jnp.asarray([1.0, 7.0, 3.0], jnp.float32)
    got = fp8.next_scales(hist, old, margin=1)
    assert _same(got, jnp.asarray([448.0 / 2 / 2, 7.0, 57344.0 / 8 / 2], jnp.float32))  # amax 0: scale kept
    assert _same(fp8.next_scales(hist.at[0, 1].set(jnp.nan), old, 0)[0], old[0])  # non-finite amax: kept
    coll = fp8.init_collection({"p": jnp.ones((3,), jnp.float32)}, 3)
    new = fp8.update_collection(coll, {"p": jnp.asarray([1.0, 2.0, 4.0])}, 0)
    assert _same(new["amax_history"]["p"][:, 0], jnp.asarray([1.0, 2.0, 4.0]))
    assert _same(new["scale"]["p"], jnp.asarray([448.0, 224.0, 57344.0 / 4], jnp.float32))
    # several projections, one with stacked stages (2, 3): the packed update gives each one's own update
    scales = {"a": jnp.asarray([1.0, 2.0, 3.0]), "b": {"c": jnp.asarray([[5.0, 6.0, 7.0], [1.0, 1.0, 1.0]])}}
    hists = {
        "a": jax.random.uniform(jax.random.key(0), (3, 4)),
        "b": {"c": jax.random.uniform(jax.random.key(1), (2, 3, 4))},
    }
    amax = {"a": jnp.asarray([3.0, jnp.nan, 0.0]), "b": {"c": jnp.asarray([[1.0, 2.0, 3.0], [4.0, 5.0, 0.5]])}}
    got = fp8.update_collection({"scale": scales, "amax_history": hists}, amax, 1)
    want_h = jax.tree.map(lambda h, a: jnp.concatenate([a[..., None], h[..., :-1]], axis=-1), hists, amax)
    want_s = jax.tree.map(lambda h, s: fp8.next_scales(h, s, 1), want_h, scales)
    assert jax.tree.structure(got) == jax.tree.structure({"scale": scales, "amax_history": hists})
    for a, b in zip(
        jax.tree.leaves((want_s, want_h)), jax.tree.leaves((got["scale"], got["amax_history"])), strict=True
    ):
        assert _same(a, b)
    assert not _same(got["scale"]["a"], scales["a"]) and _same(got["scale"]["a"][1], scales["a"][1])  # NaN: kept


def test_fp8_run_is_repeatable_and_its_scales_come_from_earlier_steps(cfg_of, reference, tmp_path):
    """L1 in one process (the compiled step is shared; L1 across processes is the GPU figure): the second run's
    fingerprints -- with the scales' and histories' digest -- and final state equal the first's. Every
    checkpointed step s: histories are the step before's shifted by one, step 0 starts at scale 1 with zero
    histories, and the scales equal next_scales of the histories (the amaxes of steps < s); step 1's histories
    hold step 0's amaxes and zeros behind them."""
    again = train(cfg_of(), tmp_path / "again")
    a = (reference.run_dir / "fingerprints.jsonl").read_bytes()
    assert len(a.splitlines()) == STEPS and '"collections"' in a.decode()
    assert a == (again.run_dir / "fingerprints.jsonl").read_bytes()
    assert host_bytes(reference.state) == host_bytes(again.state)
    cfg = cfg_of()
    colls = [_restore(reference.run_dir, cfg, s).collections["fp8"] for s in range(1, STEPS + 1)]
    # before step 0 (not checkpointed): every scale 1, every history zero -- what init_state builds
    colls.insert(0, fp8.init_collection(jax.tree.map(lambda _: jnp.ones(3, jnp.float32), colls[0]["scale"]), 3))
    for s in range(1, STEPS + 1):
        prev, cur = colls[s - 1], colls[s]
        for hp, hc, sp, sc in zip(
            *(jax.tree.leaves(t) for t in (prev["amax_history"], cur["amax_history"], prev["scale"], cur["scale"])),
            strict=True,
        ):
            assert _same(hc[:, 1:], hp[:, :-1]), s
            assert np.all(np.asarray(hc[:, 0]) > 0), s
            assert _same(sc, fp8.next_scales(hc, sp, 0)), s
    assert all(not np.any(np.asarray(h[:, 1:])) for h in jax.tree.leaves(colls[1]["amax_history"]))
    assert not _same(jax.tree.leaves(colls[2]["scale"])[0], jax.tree.leaves(colls[1]["scale"])[0])
    init = Trainer(cfg).abstract_state().collections["fp8"]  # the state's own initial collection has this shape
    assert jax.tree.structure(init) == jax.tree.structure(colls[1])


def test_fp8_resume_is_bitwise_and_a_changed_scale_is_refused(cfg_of, reference, tmp_path, monkeypatch):
    """L2: stop after step 3 (odd), resume, finish: fingerprints and state equal the uninterrupted run's.
    Negative control: a resume whose restored scales are nudged by one ulp diverges. A saved scale whose
    bytes change between save and restore is refused, naming the leaf."""
    run, bad = tmp_path / "run", tmp_path / "nudged"
    first = train(cfg_of("run.stop_after=3"), run)
    assert first.stopped_by == "stop_after" and int(first.state.step) == 3
    shutil.copytree(run, bad)
    got = train(cfg_of(), run, resume=True)
    assert (reference.run_dir / "fingerprints.jsonl").read_bytes() == (run / "fingerprints.jsonl").read_bytes()
    assert host_bytes(reference.state) == host_bytes(got.state)

    def nudge(state, batches):
        scale = jax.tree.map(lambda s: jnp.nextafter(s, jnp.inf), state.collections["fp8"]["scale"])
        return state.replace(collections={"fp8": {**state.collections["fp8"], "scale": scale}}), batches

    nudged = train(cfg_of(), bad, resume=True, after_restore=nudge)
    assert host_bytes(nudged.state) != host_bytes(reference.state)

    cfg = cfg_of()
    original = Checkpointer.restore

    def flip_scale(self, *a, **k):
        real = self.manager.restore

        def corrupt(*ra, **rk):
            got = real(*ra, **rk)
            if "state" not in got:  # the meta-only read
                return got
            leaf = got["state"]["collections"]["fp8"]["scale"]
            first_path = jax.tree_util.tree_flatten_with_path(leaf)[0][0][0]
            raw = np.array(jax.device_get(jax.tree.leaves(leaf)[0]))
            raw.view(np.uint8)[1] ^= 0x01  # one flipped bit of one saved scale
            got["state"]["collections"]["fp8"]["scale"] = jax.tree_util.tree_map_with_path(
                lambda p, x: jnp.asarray(raw) if p == first_path else x, leaf
            )
            return got

        self.manager.restore = corrupt
        return original(self, *a, **k)

    assert _restore(reference.run_dir, cfg, STEPS).step == STEPS  # control: the unaltered checkpoint restores
    monkeypatch.setattr(Checkpointer, "restore", flip_scale)
    with pytest.raises(CheckpointError, match=r"leaf \['collections'\]\['fp8'\]\['scale'\].* corrupt"):
        _restore(reference.run_dir, cfg, STEPS)


@pytest.mark.parametrize(
    "over, key",
    [
        (["trace.level=module", "trace.steps=1"], "trace.level"),
    ],
)
def test_fp8_is_refused_where_it_has_no_deterministic_path(tiny_path, over, key):
    with pytest.raises(ConfigError, match=rf"'{key}'.*model.fp8.*Fix: .*model.fp8.enabled=false"):
        load_config(tiny_path, ["model.fp8.enabled=true", *over])
    load_config(tiny_path, over)  # control: the same settings without fp8 are accepted


# ~60 s on 2 cores; covered in kind by test_matmul.py's test_fp8_mosaic_product_is_exact_and_scaled (the
# products) and the fused Mosaic-path tests below (quantization with partial tiles, the custom VJPs)
@pytest.mark.extended
def test_fp8_matmul_mosaic_path_matches_the_triton_path(monkeypatch):
    """The Mosaic fp8 path of fp8_matmul (forced here; on Hopper it is taken for large weights): the
    transposed copies made while quantizing, the residual x8^T, the epilogue scale and dw's token chunks
    (2304 tokens: 2048 + a part). On small-integer values with scale 1 every product and sum is exact, so
    forward, dx, dw and the amaxes must equal the reference path's (XLA's dot) byte for byte, also for a
    shape of partial tiles in every dimension (zero-padded while quantizing). The kernels run
    interpreted on CPU, compiled (Triton quantization, Mosaic wgmma) on a Hopper GPU. Negative control: one
    changed input value changes dw."""
    from detjax.pallas_kernels.matmul import kernel, mosaic

    if jax.default_backend() == "gpu" and not mosaic.available():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    monkeypatch.setattr(kernel, "use_mosaic_fp8", lambda *a: True)
    s = jnp.ones((3,), jnp.float32)

    def operands(m, k, n):
        ks = jax.random.split(jax.random.key(4), 3)
        x = jax.random.randint(ks[0], (m, k), -3, 4).astype(jnp.bfloat16)
        w = jax.random.randint(ks[1], (k, n), -3, 4).astype(jnp.float32)
        g = jax.random.randint(ks[2], (m, n), -3, 4).astype(jnp.float32)
        return x, w, g

    def grads(x, w, g, kernels):
        f = lambda x, w, s: jnp.sum(fp8.fp8_matmul(x, w, s, jnp.bfloat16, kernels).astype(jnp.float32) * g)  # noqa: E731
        return fp8.fp8_matmul(x, w, s, jnp.bfloat16, kernels), jax.grad(f, argnums=(0, 1, 2))(x, w, s)

    # whole tiles; then every dimension a partial tile (the quantization writes the padded copies)
    for m, k, n in ((300, 200, 136), (2304, 128, 256)):
        x, w, g = operands(m, k, n)
        got, ref = grads(x, w, g, "pallas"), grads(x, w, g, "reference")
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            assert a.shape == b.shape and _same(a, b), (m, k, n)
    x2 = x.at[2200, 5].add(1)  # a token of the second dw chunk
    assert not _same(grads(x2, w, g, "pallas")[1][1], got[1][1]), "negative control: the input must change dw"


@pytest.mark.parametrize("path", ["reference", "mosaic"])
def test_widened_fp8_products_give_the_bits_of_a_cast_after(path, monkeypatch):
    """fp8_matmul and fp8_swiglu_mlp with `widen` (a float32 result, its float32 cotangent rounded to the
    compute dtype inside the backward's quantization): output, every gradient and every amax byte-equal to
    the unwidened product followed by .astype(float32), on XLA's path and on the Mosaic path (its kernels
    interpreted on CPU, compiled on a Hopper GPU). The cotangent is general float32, so a backward that
    skipped the rounding would quantize other values; negative control: its float32 amax is not the
    rounded one the products report."""
    from detjax.pallas_kernels.matmul import kernel, mosaic

    if path == "mosaic":
        if jax.default_backend() == "gpu" and not mosaic.available():
            pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
        monkeypatch.setattr(kernel, "use_mosaic_fp8", lambda *a: True)
    kernels = "pallas" if path == "mosaic" else "reference"
    bf, f32 = jnp.bfloat16, jnp.float32
    ks = jax.random.split(jax.random.key(11), 5)
    m, d, f = 256, 256, 256
    x = jax.random.normal(ks[0], (m, d)).astype(bf)
    w = 0.05 * jax.random.normal(ks[1], (d, d))
    w_gu, w_dn = 0.05 * jax.random.normal(ks[2], (d, 2 * f)), 0.05 * jax.random.normal(ks[3], (f, d))
    g = 3 * jax.random.normal(ks[4], (m, d))  # float32 values bf16 cannot hold
    s = jnp.asarray([4.0, 64.0, 8.0], f32)

    def run(fn, *args):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(g)

    def matmul(widen):
        def fn(x, w, s):
            if widen:
                return fp8.fp8_matmul(x, w, s, bf, kernels, True)
            return fp8.fp8_matmul(x, w, s, bf, kernels).astype(f32)

        return fn

    def mlp(widen):
        def fn(x, w_gu, w_dn, s_gu, s_dn):
            if widen:
                return fp8.fp8_swiglu_mlp(x, w_gu, w_dn, s_gu, s_dn, None, bf, True)
            return fp8.fp8_swiglu_mlp(x, w_gu, w_dn, s_gu, s_dn, None, bf).astype(f32)

        return fn

    cases = [(matmul, (x, w, s))]
    if path == "mosaic":  # fp8_swiglu_mlp is the Mosaic path's MLP
        cases.append((mlp, (x, w_gu, w_dn, s, s)))
    for make, args in cases:
        got, want = run(make(True), *args), run(make(False), *args)
        assert got[0].dtype == f32
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.dtype == b.dtype and _same(a, b), (make.__name__, a.shape)
        amax_g = got[1][-1][2] if make is matmul else got[1][4][2]
        assert _same(amax_g, jnp.max(jnp.abs(g.astype(bf).astype(f32))))
        assert not _same(amax_g, jnp.max(jnp.abs(g))), "negative control: rounding moves the amax"


def test_fused_swiglu_mlp_is_exact_and_its_amaxes_are_the_products():
    """fp8_swiglu_mlp (the MLP on the Mosaic path, one device): gate+up product, SwiGLU fused with h's
    quantization, down product, and the backward with dy's quantization fused likewise, against the same
    math composed unfused: XLA's quantize, quantize.swiglu / swiglu_grads, and the six products as single
    calls of kernel.fp8_nt -- and, on CPU, also as XLA float32 dots. The operands keep every sum exact in
    float32 (x in {-1, 0, 1}, weights with one nonzero in [-3, 3] per column, small-integer cotangents), so
    on CPU the output, dx, both weight gradients and both amax sets must be byte-equal to both references.
    On the GPU only to the fp8_nt one: Hopper's fp8 wgmma keeps fewer than float32's bits while it
    accumulates, so the dense token sums of dw are not exact there (the first run showed it). The kernels
    run interpreted on CPU, compiled (Triton, Mosaic wgmma) on a Hopper GPU. Negative control: one changed
    token changes both weight gradients."""
    from detjax.pallas_kernels.matmul import mosaic
    from detjax.pallas_kernels.matmul.quantize import quantize, swiglu, swiglu_grads

    if jax.default_backend() == "gpu" and not mosaic.available():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    m, d, f = 256, 256, 256
    ks = jax.random.split(jax.random.key(7), 6)

    def sparse_cols(k1, k2, rows, cols):  # one nonzero in [-3, 3] \ {0} per column
        at = jax.random.randint(k1, (cols,), 0, rows)
        v = jax.random.randint(k2, (cols,), 1, 4) * jnp.where(jnp.arange(cols) % 2 == 0, 1, -1)
        return jnp.zeros((rows, cols), jnp.float32).at[at, jnp.arange(cols)].set(v.astype(jnp.float32))

    x = jax.random.randint(ks[0], (m, d), -1, 2).astype(jnp.bfloat16)
    w_gu, w_dn = sparse_cols(ks[1], ks[2], d, 2 * f), sparse_cols(ks[3], ks[4], f, d)
    g_out = jax.random.randint(ks[5], (m, d), -3, 4).astype(jnp.float32)
    s_gu, s_dn = jnp.ones((3,), jnp.float32), jnp.ones((3,), jnp.float32)
    e4, e5, bf, f32 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float32
    from detjax.pallas_kernels.backend import interpret_mode
    from detjax.pallas_kernels.matmul.kernel import fp8_nt

    xla_dot = lambda a, b: jnp.dot(a.astype(f32), b.astype(f32), precision=jax.lax.Precision.HIGHEST)  # noqa: E731
    nt_dot = lambda a, b: fp8_nt(a, b.T, 1.0, out_dtype=f32, r_chunk=0, interpret=interpret_mode())  # noqa: E731
    amax = lambda v: jnp.max(jnp.abs(v.astype(f32)))  # noqa: E731

    def reference(x, dot):
        x8, w8, wd8 = quantize(x, 1.0, e4), quantize(w_gu, 1.0, e4), quantize(w_dn, 1.0, e4)
        y = dot(x8, w8).astype(bf)
        g, u = y[:, :f].astype(f32), y[:, f:].astype(f32)
        h = swiglu(g, u)
        h8 = quantize(h, 1.0, e4)
        out = dot(h8, wd8).astype(bf)
        g8 = quantize(g_out.astype(bf), 1.0, e5)
        dh = dot(g8, wd8.T).astype(bf)
        dgate, dup = swiglu_grads(g, u, dh.astype(f32))
        dy = jnp.concatenate([dgate, dup], axis=1)
        dy8 = quantize(dy, 1.0, e5)
        grads = (dot(dy8, w8.T).astype(bf), dot(x8.T, dy8), dot(h8.T, g8))
        amaxes = (jnp.stack([amax(x), amax(w_gu), amax(dy)]), jnp.stack([amax(h), amax(w_dn), amax(g8)]))
        return out, grads, amaxes

    def fused(x, copies=None):
        def loss(x, w_gu, w_dn, s_gu, s_dn):
            out = fp8.fp8_swiglu_mlp(x, w_gu, w_dn, s_gu, s_dn, copies, bf)
            return jnp.sum(out.astype(f32) * g_out), out

        (_, out), (dx, dw_gu, dw_dn, a_gu, a_dn) = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
            x, w_gu, w_dn, s_gu, s_dn
        )
        return out, (dx, dw_gu, dw_dn), (a_gu, a_dn)

    got = fused(x)
    for dot in [nt_dot] + ([xla_dot] if jax.default_backend() == "cpu" else []):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference(x, dot)), strict=True):
            assert _same(a, b), (a.shape, a.dtype, dot is xla_dot)
    assert float(jnp.max(jnp.abs(got[1][1]))) > 0 and float(jnp.max(jnp.abs(got[1][2]))) > 0
    x2 = x.at[100].set(-x[100])
    # the weights quantized beforehand, as the step's compute copies hold them on the Mosaic path
    # (fp8.weight_copy there): the changed token's run reads them, and its dx rows of the other tokens agree
    pads = lambda w: fp8._mosaic_pads(1, *w.shape)[1:]  # noqa: E731
    copies = tuple(
        (*fp8._quantize_padded(w, s, 1, e4, *pads(w), amax_tiles=False), fp8.dequant_factors(s))
        for w, s in ((w_gu, s_gu), (w_dn, s_dn))
    )
    got2 = fused(x2, copies)
    assert not _same(got2[1][1], got[1][1]) and not _same(got2[1][2], got[1][2]), "negative control"
    assert _same(jnp.delete(got2[1][0], 100, axis=0), jnp.delete(got[1][0], 100, axis=0))
    assert _same(got2[2][0][1], got[2][0][1]) and _same(got2[2][1][1], got[2][1][1])  # the weights' amaxes


def test_plain_fp8_baseline_follows_delayed_scaling(tiny_path):
    """scripts/plain_step.py with model.fp8 (det_tax's `plain+model.fp8.enabled=true`, the Flax fp8 recipe the
    detjax fp8 step is timed against): its metadata after a step holds, for the first block's q projection,
    the largest |input| over the WHOLE batch (the maximum over both microbatches: a sum would double it, the
    last microbatch alone would miss the first's), and after two steps every scale has left 1 (the scales
    follow the histories). Negative control: the bf16 step's loss differs from the fp8 step's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import plain_step

    with jax.numpy_rank_promotion("allow"):  # the script is plain JAX: it broadcasts ranks
        _plain_fp8_checks(plain_step, tiny_path)


def _plain_fp8_checks(plain_step, tiny_path):
    over = ["model.pattern='*-'", "model.mtp.depth=0", "model.dropout=0", "train.global_batch=4"]
    over += ["train.micro_batch=2", "train.seq_len=16", "determinism.mode=off"]
    cfg = load_config(tiny_path, [*over, "model.fp8.enabled=true", "model.fp8.lm_head=true"])
    init, step = plain_step.build(cfg, "xla")
    params, opt, meta = init(jax.random.key(0))
    # token 0's embedding is one-hot, so its normed row peaks at sqrt(d): the first microbatch's amax is
    # well above the second's, which has no token 0
    params["embed"] = params["embed"].at[0].set(jnp.zeros((cfg.model.d_model,)).at[0].set(1.0))
    batch = jax.random.randint(jax.random.key(1), (4, 17), 1, cfg.model.vocab_size).at[0, 3].set(0)
    x = params["embed"][batch[:, :-1]].astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.model.norm_eps) * params["blocks"][0]["norm"]
    want = jnp.max(jnp.abs(y.astype(jnp.bfloat16).astype(jnp.float32)))
    halves = [jnp.max(jnp.abs(y[i : i + 2].astype(jnp.bfloat16).astype(jnp.float32))) for i in (0, 2)]
    params, opt, meta, loss8 = step(params, opt, batch, meta)
    got = jnp.max(meta["blocks"][0]["q"]["lhs_amax_history"])
    assert float(halves[0]) == float(want) > 1.5 * float(halves[1])  # the microbatches' amaxes differ
    assert np.isclose(float(got), float(want), rtol=1e-2), (got, want, halves)
    params, opt, meta, _ = step(params, opt, batch, meta)
    scales = [v for k, v in jax.tree_util.tree_leaves_with_path(meta) if "scale" in jax.tree_util.keystr(k)]
    assert len(scales) == 3 * 6 and all(float(s[0]) != 1.0 for s in scales)
    cfg16 = load_config(tiny_path, over)
    init16, step16 = plain_step.build(cfg16, "xla")
    assert float(step16(*init16(jax.random.key(0)), batch)[-1]) != float(loss8)


def _head_ce_case(m, k, n, seed=5):
    ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(jnp.bfloat16)  # the products take the compute dtype
    w = 0.05 * jax.random.normal(ks[1], (k, n), jnp.float32)
    t = jax.random.randint(ks[2], (m,), 0, n)
    return x, w, t, jnp.asarray([4.0, 64.0, 4096.0], jnp.float32)


def test_fused_fp8_head_ce_is_its_composed_math(monkeypatch):
    """fp8_head_ce (the fp8 LM head and its cross-entropy as one operation, on the Mosaic path): its
    per-token losses, dx, dw and amaxes against the same math composed from its parts -- fp8_nt products,
    XLA's quantization, logsumexp and quantize.ce_grad's formula. A shape of partial tiles in every dimension
    (the gradient kernel pads its copies). On CPU (kernels interpreted) byte-equal throughout; on a Hopper
    GPU the losses byte-equal, the gradients within the e5m2 rounding of the kernel's exp against XLA's, and
    two calls byte-equal. Against the unfused head (fp8_matmul widened + token_ce): the same losses; the
    gradients close (the fused kernel quantizes the float32 gradient once, the unfused path rounds it to bf16
    first). Negative control: one changed target changes dw and that token's dx row only."""
    from detjax.pallas_kernels.backend import interpret_mode
    from detjax.pallas_kernels.matmul import kernel, mosaic
    from detjax.pallas_kernels.matmul.kernel import fp8_nt
    from detjax.pallas_kernels.matmul.quantize import ce_grad, quantize

    if jax.default_backend() == "gpu" and not mosaic.available():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    monkeypatch.setattr(kernel, "use_mosaic_fp8", lambda *a: True)
    bf, f32, e4, e5 = jnp.bfloat16, jnp.float32, fp8.E4M3, fp8.E5M2
    m, k, n = 300, 256, 400
    x, w, t, s = _head_ce_case(m, k, n)
    dce = jnp.ones((m,), f32) * 0.5

    # (each forward finishes before its backward starts: two interpreted Mosaic programs in flight at once can
    # stall the CPU interpreter's threads)
    def fused(x, w, s, t):
        ce, vjp = jax.vjp(lambda x, w, s: fp8.fp8_head_ce(x, w, None, s, t, bf, "pallas"), x, w, s)
        return jax.block_until_ready(ce), jax.block_until_ready(vjp(dce))

    def unfused(x, w, s):
        ce, vjp = jax.vjp(lambda x, w, s: loss.token_ce(fp8.fp8_matmul(x, w, s, bf, "pallas", True), t)[0], x, w, s)
        return jax.block_until_ready(ce), jax.block_until_ready(vjp(dce))

    nt = lambda a, b, inv, out: fp8_nt(a, b, inv, out_dtype=out, r_chunk=0, interpret=interpret_mode())  # noqa: E731

    def composed():
        x8, w8 = quantize(x, s[0], e4), quantize(w, s[1], e4)
        logits = nt(x8, w8.T, 1.0 / (s[0] * s[1]), bf)
        ce, lse = loss.token_ce(logits.astype(f32), t)
        d = ce_grad(logits, lse, t, dce)
        g8 = quantize(d, s[2], e5)
        dx = nt(g8, w8, 1.0 / (s[2] * s[1]), bf)
        dw = nt(x8.T, g8.T, 1.0 / (s[0] * s[2]), f32)  # 300 tokens: one dw chunk
        amax = jnp.stack([jnp.max(jnp.abs(x)), jnp.max(jnp.abs(w)), jnp.max(jnp.abs(d))])
        return ce, (dx, dw, amax)

    got = fused(x, w, s, t)
    want = jax.block_until_ready(composed())
    plain = unfused(x, w, s)
    assert got[1][0].dtype == bf and got[1][1].dtype == f32 and got[0].shape == (m,)
    assert _same(got[0], want[0]) and _same(got[0], plain[0]), "the forward is the unfused head's"
    if jax.default_backend() == "cpu":
        for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
            assert _same(a, b), a.shape
    else:
        again = fused(x, w, s, t)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again), strict=True):
            assert _same(a, b), ("repeat", a.shape)
        for a, b in zip(got[1][:2], want[1][:2], strict=True):
            assert float(jnp.max(jnp.abs(a.astype(f32) - b.astype(f32)))) <= 0.02 * float(jnp.max(jnp.abs(b)))
    for a, b in zip(got[1][:2], plain[1][:2], strict=True):  # the unfused head's gradients: close, not equal
        assert float(jnp.max(jnp.abs(a.astype(f32) - b.astype(f32)))) <= 0.05 * float(jnp.max(jnp.abs(b)))
    t2 = t.at[17].set((t[17] + 1) % n)
    other = fused(x, w, s, t2)
    assert not _same(other[1][1], got[1][1]), "negative control: a changed target changes dw"
    assert not _same(other[1][0][17], got[1][0][17])
    assert _same(jnp.delete(other[1][0], 17, axis=0), jnp.delete(got[1][0], 17, axis=0))


@pytest.mark.extended  # ~45 s; the default run has the fused operation against its composed math (above)
def test_fused_fp8_head_in_the_model(tiny_path, monkeypatch):
    """model.fp8.lm_head on the Mosaic path (forced here for the head alone): the trainer's microbatch
    objective passes the targets, the LM and MTP heads return their per-token losses (fp8.TokenCE, the
    fused gradient kernel in the program), and the loss terms are byte-equal to the unfused heads' (the
    same logits and formulas) while every gradient and amax stays within 10 % of theirs (relative error of
    each leaf: the e5m2 gradients round differently); the step's fp8 copy of w_head is read: byte-equal to
    quantizing at each use. Negative control of that: _assert_copies_exact's copies made with other scales
    (test_fp8_lm_head_shares_one_scale_set...) change the loss."""
    from detjax.model import lm
    from detjax.pallas_kernels.matmul import kernel, mosaic

    if jax.default_backend() == "gpu" and not mosaic.available():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    over = ["model.pattern='*-'", "train.seq_len=16", "model.mtp.depth=1", "model.fp8.lm_head=true"]
    vocab = load_config(tiny_path).model.vocab_size
    monkeypatch.setattr(kernel, "use_mosaic_fp8", lambda a, b, k, n, interp: n == vocab)
    _, _, scales, copies_of, grads = _copies_case(tiny_path, over)
    compute = copies_of(scales)
    assert "fp8_ce_grad_quantize" in str(jax.make_jaxpr(grads)(compute))
    fused = _assert_copies_exact(grads, compute)
    head_only = {**compute, "w_head": copies_of(jax.tree.map(lambda s: s * 2.0, scales))["w_head"]}
    assert not _same(grads(head_only)[1][0], fused[1][0])
    monkeypatch.setattr(lm, "fused_head_ce", lambda *a: False)
    plain = jax.device_get(_copies_case(tiny_path, over)[4](compute))
    (g_f, a_f), terms_f = fused
    (g_p, a_p), terms_p = plain
    assert _same(terms_f[0], terms_p[0]) and _same(terms_f[1], terms_p[1]), "LM and MTP sums"
    for a, b in zip(jax.tree.leaves((g_f, a_f)), jax.tree.leaves((g_p, a_p)), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)  # each leaf's relative error as a whole: the
        # e5m2 gradients' roundings differ (2 mantissa bits), CPU run: 0 to 6.5 %
        assert np.linalg.norm(a - b) <= 0.1 * np.linalg.norm(b)


def test_fp8_qkv_product_with_rope_is_its_composed_math(monkeypatch):
    """fp8_matmul_rope (the attention block's fp8 q/k/v product with RoPE, on the Mosaic path): its outputs,
    dx, dw and amaxes byte-equal to fp8_matmul followed by rope.ops.split_rope, whose backward writes dy in
    bf16 for fp8_matmul's backward to quantize -- the fused backward quantizes it in the RoPE kernel instead.
    With the step's weight copy the same bytes again, and fp8_dense_many takes the fused path for q/k/v.
    Negative control: another theta changes dx."""
    from detjax.pallas_kernels.matmul import kernel, mosaic
    from detjax.pallas_kernels.rope.ops import split_rope

    if jax.default_backend() == "gpu" and not mosaic.available():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    monkeypatch.setattr(kernel, "use_mosaic_fp8", lambda *a: True)
    bf = jnp.bfloat16
    shape, theta = (2, 128, 4, 2, 64), 1e4
    m, k, n = 256, 128, (4 + 2 * 2) * 64
    assert fp8.fused_rope(m, k, n, "pallas") and not fp8.fused_rope(m, k, n, "reference")
    ks = jax.random.split(jax.random.key(9), 5)
    x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(bf)
    w = 0.05 * jax.random.normal(ks[1], (k, n), jnp.float32)
    s = jnp.asarray([4.0, 64.0, 2048.0], jnp.float32)
    cts = tuple(
        jax.random.normal(ks[2 + i], sh, jnp.float32).astype(bf)
        for i, sh in enumerate([(2, 128, 4, 64), (2, 128, 2, 64), (2, 128, 2, 64)])
    )

    # each phase one compiled program, finished before the next starts: eager ops dispatched while an
    # interpreted Mosaic program runs can stall the CPU interpreter's threads
    def run(f):
        outs = jax.block_until_ready(jax.jit(lambda x, w, s: f(x, w, s))(x, w, s))
        grads = jax.jit(lambda x, w, s, c: jax.vjp(f, x, w, s)[1](c))(x, w, s, cts)
        return outs, jax.block_until_ready(grads)

    fused = run(lambda x, w, s: fp8.fp8_matmul_rope(x, w, None, s, shape, theta, bf, "pallas"))
    composed = run(lambda x, w, s: split_rope(fp8.fp8_matmul(x, w, s, bf, "pallas"), shape, theta))
    wq = fp8.weight_copy(w, s, "pallas")
    copied = run(lambda x, w, s: fp8.fp8_matmul_rope(x, w, wq, s, shape, theta, bf, "pallas"))
    for got in (fused, copied):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(composed), strict=True):
            assert _same(a, b), a.shape
    other = run(lambda x, w, s: fp8.fp8_matmul_rope(x, w, None, s, shape, 5e5, bf, "pallas"))
    assert not _same(other[1][0], fused[1][0])  # negative control
    specs = ["bld,dhq->blhq", "bld,dkq->blkq", "bld,dkq->blkq"]
    ws = [w[:, :256].reshape(k, 4, 64), w[:, 256:384].reshape(k, 2, 64), w[:, 384:].reshape(k, 2, 64)]
    many = lambda x: fp8.fp8_dense_many(specs, x.reshape(2, 128, k), ws, bf, s, "pallas", rope=(shape, theta))  # noqa: E731
    assert "fp8_rope_grad_quantize" in str(jax.make_jaxpr(lambda x: jax.vjp(many, x)[1](list(cts)))(x))
