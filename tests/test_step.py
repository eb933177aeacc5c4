"""The compiled train step: no scatter anywhere in the lowered or compiled HLO; one step replays bit-exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detjax.config import load_config
from detjax.data.pipeline import make_dataset
from detjax.step import Trainer, compile_init, compile_train_step


@pytest.fixture(scope="module")
def compiled(tiny_path):
    """The step exactly as `python -m detjax.train` builds it for test_train.py's tiny runs (the same config,
    layout and shardings), so that it loads their executable from the suite's persistent compilation cache
    when they ran first."""
    from test_train import STEPS

    from detjax.sharding.mesh import build_layout

    cfg = load_config(tiny_path, [f"train.steps={STEPS}"])
    trainer = Trainer(cfg, layout=build_layout(cfg))
    state_sh, batch_sh = trainer.state_shardings(), trainer.batch_sharding()
    init = compile_init(trainer, state_sh)
    step = compile_train_step(trainer, state_sh, batch_sh)
    batch = jax.device_put(np.asarray(make_dataset(cfg)[0]), batch_sh)
    lowered = step.lower(init(jax.random.key(0)), batch)
    return cfg, init, step, batch, lowered, lowered.compile()


def test_train_step_hlo_has_no_scatter(compiled):
    _, _, _, _, lowered, exe = compiled
    assert "scatter" not in lowered.as_text().lower()
    assert "scatter" not in exe.as_text().lower()


def test_scatter_add_combine_does_lower_to_scatter(tiny_path):
    """Negative control: the check above can fail."""
    cfg = load_config(tiny_path, ["model.moe.combine=scatter_add", "determinism.mode=off"])
    trainer = Trainer(cfg)
    state = jax.eval_shape(trainer.init_state, jax.random.key(0))
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len + 1), np.int32)
    assert "scatter" in jax.jit(trainer.train_step).lower(state, batch).as_text().lower()


def test_step_replays_bit_exact(compiled):
    _, init, step, batch, _, _ = compiled
    outs = []
    for _ in range(2):
        state, metrics = step(init(jax.random.key(0)), batch)
        outs.append(jax.device_get((state.params, metrics)))
    la, lb = jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])
    assert len(la) == len(lb)
    for a, b in zip(la, lb, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def test_compute_copies_are_what_the_projections_read(tiny_path):
    """model.kernels=pallas: the step's once-per-step compute copies (weights cast and fused before the
    microbatch loop) give the loss, every gradient and the held-out loss byte-equal to casting at each use,
    and the products really read them (negative control: a changed copy changes the loss); every projection
    group of the hybrid has its copy."""
    cfg = load_config(tiny_path, ["model.kernels=pallas"])
    trainer = Trainer(cfg)
    shapes = jax.eval_shape(trainer.compute_copies, jax.eval_shape(trainer.init_state, jax.random.key(0)).params)
    keys = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]}
    for want in (
        "['layer_0']['mixer']['w_in_z+w_in_x+w_in_bc+w_in_dt']",
        "['layer_0']['mixer']['w_out']",
        "['layer_1']['mixer']['w_q+w_k+w_v']",
        "['layer_1']['mixer']['w_o']",
        "['layer_2']['mixer']['shared']['w_gate+w_up']",
        "['layer_3']['mixer']['w_gate+w_up']",
        "['layer_3']['mixer']['w_down']",
        "['w_head']",
    ):
        assert want in keys, (want, sorted(keys))

    small = ["model.pattern='-'", "model.mtp.depth=0", "model.dropout=0", "train.global_batch=2", "train.micro_batch=2"]
    cfg = load_config(tiny_path, ["model.kernels=pallas", "train.seq_len=32", *small])
    trainer = Trainer(cfg)
    state = jax.jit(trainer.init_state)(jax.random.key(0))
    params = state.params
    compute = jax.jit(trainer.compute_copies)(params)
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.model.vocab_size)

    @jax.jit
    def grads(params, compute):
        return jax.grad(trainer.micro_objective, has_aux=True)(params, tokens, jax.random.key(2), compute=compute)

    ref, with_copies = jax.device_get(grads(params, None)), jax.device_get(grads(params, compute))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(with_copies), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # the held-out loss reads the copies too: equal to the forward that casts at each use
    from detjax.loss import token_ce_sum

    @jax.jit
    def cast_at_use(params):
        logits = trainer.model.apply({"params": params}, tokens[:, :-1], train=False)[0]
        return token_ce_sum(logits, tokens[:, 1:])

    held_out = jax.jit(trainer.eval_sums)(state, tokens)
    assert np.asarray(held_out).tobytes() == np.asarray(cast_at_use(params)).tobytes()
    changed = {**compute, "w_head": compute["w_head"] * 2}
    loss = jax.device_get(grads(params, changed)[1][0])
    assert np.asarray(loss).tobytes() != np.asarray(ref[1][0]).tobytes()


def test_experts_read_their_compute_copies(tiny_path):
    """model.kernels=pallas: the routed experts' stacks get a once-per-step copy (cast, and its transpose for
    dx; gmm.ops.grouped_compute_copy); loss and every gradient are byte-equal to casting at each use, and the
    experts read the copies (negative control: the experts' copies of other weights change the loss). With
    expert dispatch (canonical numerics, mesh.expert = 2) the rows travel to the experts, which read the
    masters, and XLA's ragged_dot casts at use: no experts' copies then (control: without either there are)."""
    over = ["model.kernels=pallas", "model.pattern='E'", "model.mtp.depth=0", "model.dropout=0", "train.seq_len=32"]
    cfg = load_config(tiny_path, [*over, "train.global_batch=2", "train.micro_batch=2"])
    trainer = Trainer(cfg)
    state = jax.jit(trainer.init_state)(jax.random.key(0))
    compute = jax.jit(trainer.compute_copies)(state.params)
    experts = compute["layer_0"]["mixer"]["experts"]
    assert sorted(experts) == ["w_down", "w_gate", "w_up"]
    w_gate = state.params["layer_0"]["mixer"]["experts"]["w_gate"]
    assert experts["w_gate"][0].dtype == jnp.bfloat16 and experts["w_gate"][1].shape == jnp.swapaxes(w_gate, 1, 2).shape
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.model.vocab_size)

    @jax.jit
    def grads(compute):
        return jax.grad(trainer.micro_objective, has_aux=True)(state.params, tokens, jax.random.key(2), compute=compute)

    ref, got = jax.device_get(grads(None)), jax.device_get(grads(compute))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    doubled = jax.tree.map(lambda w: 2 * w, state.params["layer_0"]["mixer"]["experts"])
    other = jax.jit(trainer.compute_copies)({**state.params, "layer_0": {"mixer": {"experts": doubled}}})
    mixer = compute["layer_0"]["mixer"]
    changed = {**compute, "layer_0": {"mixer": {**mixer, "experts": other["layer_0"]["mixer"]["experts"]}}}
    assert np.asarray(grads(changed)[1][0]).tobytes() != np.asarray(ref[1][0]).tobytes()

    from detjax.sharding.mesh import build_layout

    def copied(over):  # which expert modules get copies, canonical numerics on the 8-device tiny mesh
        pallas = ["model.kernels=pallas", "model.head_dim=16", "model.mamba.d_state=16", "model.mamba.chunk_size=16"]
        cfg = load_config("configs/tiny_mesh.yaml", ["determinism.numerics=canonical", *pallas, *over])
        trainer = Trainer(cfg, layout=build_layout(cfg))
        shapes = jax.eval_shape(trainer.compute_copies, jax.eval_shape(trainer.init_state, jax.random.key(0)).params)
        return [k for k, _ in jax.tree_util.tree_flatten_with_path(shapes)[0] if "experts" in jax.tree_util.keystr(k)]

    assert copied(["mesh.expert=2", "model.moe.experts_impl=pallas"]) == []
    assert copied(["model.moe.experts_impl=ragged_dot"]) == []  # XLA's grouped products cast at use
    assert copied(["model.moe.experts_impl=pallas"])  # control: no expert axis, the experts read copies


def test_gradient_accumulation_fusion_gives_the_bits_of_separate_sums(tiny_path):
    """train.grad_accumulation_fusion (on by default; with model.kernels=pallas on one device): the microbatch
    loop's gradient sums, with the projections' weight gradients added by their dw kernels to running sums in
    the fused-copy layout (and the routed experts' grouped dw to sums of their stacks' shape), equal the
    separate sums byte for byte, every leaf, on the hybrid with an MTP head (whose shared LM head keeps the
    separate sum). Negative control: the separate sums of the same three microbatches in the other order
    differ in some fused weight's gradient. A running sum that would reach two products (the shared head) is
    refused while tracing."""
    from detjax.model import layers

    over = ["model.kernels=pallas", "train.seq_len=32", "model.dropout=0", "train.global_batch=6"]
    over.append("train.micro_batch=2")
    fused_tr = Trainer(load_config(tiny_path, over))  # on by default
    plain_tr = Trainer(load_config(tiny_path, [*over, "train.grad_accumulation_fusion=false"]))
    assert fused_tr.fuses_accumulation() and not plain_tr.fuses_accumulation()
    assert fused_tr.cfg.model.mtp.depth > 0 and set("M*E-") <= set(fused_tr.cfg.model.pattern)
    state = jax.jit(fused_tr.init_state)(jax.random.key(0))
    tokens = fused_tr.micro_tokens(jax.random.randint(jax.random.key(1), (6, 33), 0, fused_tr.cfg.model.vocab_size))

    def sums_of(trainer):
        return jax.jit(lambda s, t: trainer.grad_sums(s, t, jax.random.key(3))[:2])

    fused = jax.device_get(sums_of(fused_tr)(state, tokens))
    separate_fn = sums_of(plain_tr)
    separate = jax.device_get(separate_fn(state, tokens))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(fused)[0]]
    for p, a, b in zip(paths, jax.tree.leaves(fused), jax.tree.leaves(separate), strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes(), p

    sums = fused_tr.accumulators(state.params)
    fused_keys = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(sums)[0]}
    assert "['layer_3']['mixer']['w_gate+w_up']" in fused_keys and "['w_head']" not in fused_keys
    assert {f"['layer_2']['mixer']['experts']['{n}']" for n in layers.EXPERT_STACKS} <= fused_keys
    reordered = jax.device_get(separate_fn(state, tokens[::-1]))
    moved = [
        p
        for p, a, b in zip(paths, jax.tree.leaves(fused), jax.tree.leaves(reordered), strict=True)
        if np.asarray(a).tobytes() != np.asarray(b).tobytes() and "w_gate" in p
    ]
    assert moved, "the other order of the same sums should change some fused weight's bits"

    shared = Trainer(load_config(tiny_path, [*over, "train.grad_accumulation_fusion=true"]))
    shared.accumulators = lambda params: {
        **fused_tr.accumulators(params),
        **layers.module_accumulators({"w_head": params["w_head"]}),
    }
    with pytest.raises(ValueError, match="one product"):
        jax.eval_shape(lambda s, t: shared.grad_sums(s, t, jax.random.key(3)), state, tokens)
