"""Model pieces against their oracles; the gathers' custom backward against autodiff of a plain gather."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from detjax.config import ModelConfig, MoEConfig
from detjax.model.dispatch import permute_rows
from detjax.model.layers import embed_lookup
from detjax.model.lm import HybridLM
from detjax.model.moe import MoE, moe_dense_reference, route
from detjax.pallas_kernels.flash_attention.reference import attention_reference


def test_attention_matches_jax_dot_product_attention():
    k = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k[0], (2, 16, 4, 8))
    kk = jax.random.normal(k[1], (2, 16, 2, 8))
    v = jax.random.normal(k[2], (2, 16, 2, 8))
    ours = attention_reference(q, kk, v)
    ref = jax.nn.dot_product_attention(q, kk, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("router,shared", [("softmax", False), ("sigmoid", False), ("softmax", True)])
def test_moe_equals_dense_per_token_loop(router, shared):
    cfg = MoEConfig(n_experts=4, top_k=2, ffn_dim=16, router=router, shared_expert=shared)
    layer = MoE(d_model=8, cfg=cfg, init_std=0.3, dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(1), (2, 6, 8))
    params = nn.unbox(layer.init(jax.random.key(2), x)["params"])
    y, aux = layer.apply({"params": params}, x)
    y_ref, aux_ref = moe_dense_reference(params, x, cfg, jnp.float32)
    if shared:
        from detjax.model.layers import MLP

        y_ref = y_ref + MLP(8, 16, 0.3, jnp.float32).apply({"params": params["shared"]}, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(aux), np.asarray(aux_ref))


def test_router_tie_break_is_lower_expert_id():
    logits = jnp.zeros((3, 4))  # all experts tie
    idx, gate, _ = route(logits, 2, "softmax")
    np.testing.assert_array_equal(np.asarray(idx), [[0, 1]] * 3)
    np.testing.assert_allclose(np.asarray(gate), 0.5)


def test_scatter_free_gathers_have_the_autodiff_gradient():
    table = jax.random.normal(jax.random.key(3), (11, 5))
    ids = jnp.array([[1, 3, 3, 10], [0, 1, 1, 1]])
    w = jax.random.normal(jax.random.key(4), (2, 4, 5))
    g_ours = jax.grad(lambda t: jnp.sum(embed_lookup(t, ids) * w))(table)
    g_ref = jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0) * w))(table)
    np.testing.assert_allclose(np.asarray(g_ours), np.asarray(g_ref), rtol=1e-6, atol=1e-6)

    x = jax.random.normal(jax.random.key(5), (6, 3))
    perm = jnp.array([4, 0, 5, 2, 1, 3])
    inv = jnp.argsort(perm)
    w2 = jax.random.normal(jax.random.key(6), (6, 3))
    g_p = jax.grad(lambda a: jnp.sum(permute_rows(a, perm, inv) * w2))(x)
    g_r = jax.grad(lambda a: jnp.sum(a[perm] * w2))(x)
    np.testing.assert_array_equal(np.asarray(g_p), np.asarray(g_r))  # a permutation: exact


def test_hybrid_lm_shapes_and_pattern():
    cfg = dataclasses.replace(ModelConfig(), pattern="M*E-", d_model=32, ffn_dim=32)
    m = HybridLM(cfg)
    ids = jnp.zeros((2, 16), jnp.int32)
    params = nn.unbox(jax.jit(m.init)(jax.random.key(0), ids)["params"])  # jitted: one compile, not one per op
    assert {f"layer_{i}" for i in range(4)} <= set(params)
    assert "mixer" in params["layer_2"] and "w_router" in params["layer_2"]["mixer"]
    assert "a_log" in params["layer_0"]["mixer"]
    logits, mtp_logits, aux = jax.jit(m.apply)({"params": params}, ids)
    assert logits.shape == (2, 16, cfg.vocab_size) and mtp_logits.shape == (2, 15, cfg.vocab_size)
    assert jax.tree.leaves(params)[0].dtype == jnp.float32
    assert float(aux) > 0


def test_embedding_gradient_fixed_or_scatter_add():
    """The fixed embedding gradient has no scatter and equals the scatter-add one (the fast baseline,
    model.embed_grad=scatter_add), whose jaxpr does scatter: the check can fail."""
    from detjax.model.layers import Embed

    ids = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 24)), jnp.int32)
    g = jax.random.normal(jax.random.key(1), (2, 24, 16))
    grads, jaxprs = {}, {}
    for how in ("fixed", "scatter_add"):
        emb = Embed(40, 16, 0.02, grad=how)
        params = nn.meta.unbox(emb.init(jax.random.key(0), ids))

        def loss(p, emb=emb):
            return jnp.sum(emb.apply(p, ids) * g)

        grads[how] = jax.grad(loss)(params)["params"]["table"]
        jaxprs[how] = str(jax.make_jaxpr(jax.grad(loss))(params))
    assert "scatter" not in jaxprs["fixed"] and "scatter-add" in jaxprs["scatter_add"]
    np.testing.assert_allclose(grads["fixed"], grads["scatter_add"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sort_keys", [False, True])
def test_sort_by_expert_sorts_once_and_inverts_exactly(monkeypatch, sort_keys):
    """The dispatch's inverse permutation is counted from prefix sums, not sorted: one sort in the jaxpr, and
    inv[order] == arange for random routings (some experts empty). With dispatch.SORT_KEYS the sort takes one
    operand (the keys) instead of argsort's two, and gives the same stable order."""
    from detjax.model import dispatch
    from detjax.model.dispatch import sort_by_expert

    monkeypatch.setattr(dispatch, "SORT_KEYS", sort_keys)
    for seed, (t, x, e) in enumerate([(37, 3, 8), (64, 2, 4), (5, 1, 16)]):
        idx = jax.random.randint(jax.random.key(seed), (t, x), 0, e)
        expert, order, inv, gs = (np.asarray(a) for a in sort_by_expert(idx, e))
        assert (inv[order] == np.arange(t * x)).all() and (order == np.argsort(expert, kind="stable")).all()
        assert (gs == np.bincount(expert, minlength=e)).all()
    from detjax.jaxprs import iter_eqns

    jaxpr = jax.make_jaxpr(lambda i: sort_by_expert(i, 8))(jnp.zeros((16, 2), jnp.int32))
    sorts = [eq for eq in iter_eqns(jaxpr.jaxpr) if eq.primitive.name == "sort"]
    assert len(sorts) == 1 and len(sorts[0].invars) == (1 if sort_keys else 2)


def test_xla_projection_backward_multiplies_in_the_compute_dtype():
    """model.kernels=xla: proj's backward products take bf16 operands (float32 accumulation), not the float32
    cotangent times an upcast operand (float32 GEMMs on the GPU), and its gradients are autodiff's of the
    same einsum up to the cotangent's rounding to bf16; the weight gradient is float32."""
    from detjax.jaxprs import iter_eqns
    from detjax.model.layers import proj

    x = jax.random.normal(jax.random.key(0), (2, 8, 16), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (16, 4, 8), jnp.float32) * 0.1

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2)

    ours = loss(lambda x, w: proj("bld,dhq->blhq", x, w, jnp.bfloat16))
    ref = loss(
        lambda x, w: jnp.einsum(
            "bld,dhq->blhq", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32
        ).astype(jnp.bfloat16)
    )
    jaxpr = jax.make_jaxpr(jax.grad(ours, argnums=(0, 1)))(x, w)
    dots = [e for e in iter_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars), dots
    ref_dots = [e for e in iter_eqns(jax.make_jaxpr(jax.grad(ref, argnums=(0, 1)))(x, w).jaxpr)]
    assert any(v.aval.dtype == jnp.float32 for e in ref_dots if e.primitive.name == "dot_general" for v in e.invars)
    (dx, dw), (rx, rw) = jax.grad(ours, argnums=(0, 1))(x, w), jax.grad(ref, argnums=(0, 1))(x, w)
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    np.testing.assert_allclose(dx, rx, rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(dw, rw, rtol=2e-2, atol=1e-2)


def test_ce_of_compute_dtype_logits_writes_its_gradient_in_that_dtype():
    """ce.token_ce_of: the forward's bytes are token_ce's of the widened logits; the backward is one pass of
    the ce_grad formula rounded to bf16 (byte-equal to it), close to autodiff of token_ce and rounded, and it
    keeps the bf16 logits for the backward where autodiff of the widened logits keeps a float32 copy.
    Negative control: other cotangents give other bytes."""
    from detjax.model.ce import token_ce, token_ce_of
    from detjax.pallas_kernels.matmul.quantize import ce_grad

    b, length, v = 2, 8, 96
    logits = (3 * jax.random.normal(jax.random.key(0), (b, length, v))).astype(jnp.bfloat16)
    targets = jax.random.randint(jax.random.key(1), (b, length), 0, v)
    dce = jax.random.uniform(jax.random.key(2), (b, length), minval=0.5, maxval=2.0)

    ce, vjp = jax.vjp(lambda x: token_ce_of(x, targets), logits)
    want = token_ce(logits.astype(jnp.float32), targets)[0]
    np.testing.assert_array_equal(np.asarray(ce).view(np.uint32), np.asarray(want).view(np.uint32))

    (g,) = vjp(dce)
    assert g.dtype == jnp.bfloat16 and g.shape == logits.shape
    lse = token_ce(logits.astype(jnp.float32), targets)[1]
    formula = ce_grad(logits.reshape(-1, v), lse.reshape(-1), targets.reshape(-1), dce.reshape(-1))
    formula = formula.astype(jnp.bfloat16).reshape(logits.shape)
    np.testing.assert_array_equal(np.asarray(g).view(np.uint16), np.asarray(formula).view(np.uint16))

    autodiff = jax.vjp(lambda x: token_ce(x.astype(jnp.float32), targets)[0], logits)[1](dce)[0]
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(autodiff, np.float32), rtol=2e-2, atol=1e-3)

    (g2,) = vjp(dce * 1.5)
    assert np.asarray(g2).view(np.uint16).tobytes() != np.asarray(g).view(np.uint16).tobytes()

    def saved(vjp_fn):  # the (tokens x vocabulary) arrays a vjp keeps for the backward, by dtype
        return sorted(str(r.dtype) for r in jax.tree.leaves(vjp_fn) if getattr(r, "shape", ()) == logits.shape)

    assert saved(vjp) == ["bfloat16"]
    assert "float32" in saved(jax.vjp(lambda x: token_ce(x.astype(jnp.float32), targets)[0], logits)[1])


def test_bf16_head_returns_its_token_losses_under_pallas_kernels():
    """In training (targets given) the bf16 LM head under model.kernels=pallas returns TokenCE, whose sum is the
    loss of the logits it returns without targets; under model.kernels=reference it returns the logits."""
    from detjax.loss import token_ce_sum
    from detjax.model.ce import TokenCE

    ids = jax.random.randint(jax.random.key(3), (2, 17), 0, 128)
    for kernels in ("pallas", "reference"):
        cfg = dataclasses.replace(
            ModelConfig(),
            pattern="*",
            d_model=32,
            ffn_dim=64,
            n_heads=2,
            n_kv_heads=1,
            head_dim=16,
            vocab_size=128,
            kernels=kernels,
            mtp=dataclasses.replace(ModelConfig().mtp, depth=0),
        )
        m = HybridLM(cfg)
        params = nn.unbox(jax.jit(m.init)(jax.random.key(0), ids[:, :-1])["params"])
        out = jax.jit(lambda p, m=m: m.apply({"params": p}, ids[:, :-1], targets_BL=ids[:, 1:]))(params)[0]
        logits = jax.jit(lambda p, m=m: m.apply({"params": p}, ids[:, :-1]))(params)[0]
        assert logits.dtype == jnp.float32
        if kernels == "pallas":
            assert isinstance(out, TokenCE)
            want = token_ce_sum(logits, ids[:, 1:])
            assert np.asarray(jnp.sum(out.ce_BL)).view(np.uint32) == np.asarray(want).view(np.uint32)
        else:
            assert not isinstance(out, TokenCE)
