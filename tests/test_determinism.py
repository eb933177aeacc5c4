"""Strict mode: XLA flags before JAX starts, a clear error after, refusal of features, the policy record."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from detjax import determinism
from detjax.config import load_config


def test_strict_refuses_scatter_add_combine(tiny_path):
    cfg = load_config(tiny_path, ["model.moe.combine=scatter_add"])
    with pytest.raises(determinism.DeterminismError, match=r"model\.moe\.combine.*Fix: use model\.moe\.combine=gather"):
        determinism.check_features(cfg)


def test_strict_refuses_xla_attention(tiny_path):
    cfg = load_config(tiny_path, ["model.attention_impl=xla"])
    with pytest.raises(determinism.DeterminismError, match="model.attention_impl"):
        determinism.check_features(cfg)


@pytest.mark.parametrize("over", ["model.attention_impl=cudnn", "model.embed_grad=scatter_add"])
def test_strict_refuses_the_other_fast_paths(tiny_path, over):
    key = over.split("=")[0]
    with pytest.raises(determinism.DeterminismError, match=rf"{key.replace('.', r'[.]')}: .*Fix: "):
        determinism.check_features(load_config(tiny_path, [over]))


def test_cudnn_attention_is_refused_off_a_gpu(tiny_path):
    """cuDNN's fused attention needs an NVIDIA GPU: elsewhere the mesh builder refuses it with a one-line fix
    (instead of jax's "cuDNN is not detected" from inside the model's trace)."""
    import jax

    from detjax.config import ConfigError
    from detjax.sharding.mesh import build_layout

    if jax.default_backend() != "cpu":
        pytest.skip("checks the refusal on a machine without a GPU")
    cfg = load_config(tiny_path, ["model.attention_impl=cudnn", "determinism.mode=off"])
    with pytest.raises(ConfigError, match=r"'model\.attention_impl' = 'cudnn'.*needs an NVIDIA GPU.*Fix: "):
        build_layout(cfg)


def test_off_mode_allows_them(tiny_path):
    over = ["model.attention_impl=xla", "model.moe.combine=scatter_add", "model.embed_grad=scatter_add"]
    off = load_config(tiny_path, [*over, "determinism.mode=off"])
    # the features without a deterministic path are there, and off mode lets them run
    want = {"model.attention_impl", "model.moe.combine", "model.embed_grad"}
    assert {r.key for r in determinism.refused_features(off)} == want
    assert determinism.check_features(off) is None


def test_cli_refusal_exit_code(python, tiny_path):
    r = subprocess.run(
        [python, "-m", "detjax.train", "--config", str(tiny_path), "model.moe.combine=scatter_add"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "no deterministic path" in r.stderr


def test_error_when_jax_started_without_flags(python):
    code = (
        "import jax; jax.devices()\n"
        "from detjax import determinism\n"
        "try:\n    determinism.apply_environment('strict')\n"
        "except determinism.DeterminismError as e:\n    print('REFUSED', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)
    assert "REFUSED" in r.stdout and "already initialised" in r.stdout and "XLA_FLAGS" in r.stdout


def test_flags_are_set_before_jax_starts(python):
    code = (
        "from detjax import determinism; determinism.apply_environment('strict')\n"
        "import jax, os; jax.devices(); print(os.environ['XLA_FLAGS'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    for f in determinism.STRICT_XLA_FLAGS:
        assert f in r.stdout


def test_policy_record(tiny_path, tmp_path):
    cfg = load_config(tiny_path)
    rec = determinism.write_policy(cfg, tmp_path / "determinism.json")
    on_disk = json.loads((tmp_path / "determinism.json").read_text())
    assert on_disk == rec
    assert rec["mode"] == "strict" and rec["config_hash"] == cfg.hash()
    assert rec["versions"]["jax"] and rec["device_kind"]
    assert all(f in rec["xla_flags"] for f in determinism.STRICT_XLA_FLAGS)
    assert set(rec["code"]) == {"detjax", "git_commit", "git_dirty"}


def test_code_revision_names_this_checkout_and_nothing_else(tmp_path):
    """determinism.json's "code": in a git checkout of detjax, its HEAD commit; None outside a checkout and
    in a directory that is only inside one (an installed copy within another repository)."""
    repo = Path(determinism.__file__).resolve().parents[1]
    rec = determinism.code_revision()
    if (repo / ".git").exists():
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert rec["git_commit"] == head.stdout.strip() and len(rec["git_commit"]) == 40
        assert isinstance(rec["git_dirty"], bool)
    assert determinism.code_revision(tmp_path)["git_commit"] is None
    assert determinism.code_revision(repo / "detjax")["git_commit"] is None
    line = determinism.code_line({"detjax": "0.1", "git_commit": "ab" * 20, "git_dirty": True})
    assert line == "code " + "ab" * 6 + ", with local changes"
    assert determinism.code_line({"detjax": "0.1", "git_commit": None, "git_dirty": None}).endswith("checkout)")


def test_kernels_strategy_needs_the_pallas_kernels(tiny_path):
    from detjax.config import ConfigError

    with pytest.raises(ConfigError, match=r"determinism\.strategy.*model\.kernels=pallas"):
        load_config(tiny_path, ["determinism.strategy=kernels"])
    cfg = load_config(tiny_path, ["determinism.strategy=kernels", "model.kernels=pallas"])
    # no deterministic-ops flag and no autotune cache: the GEMMs are detjax's, XLA's autotuner is off
    assert determinism.required_flags("strict", "kernels") == ("--xla_gpu_autotune_level=0",)
    rec = determinism.policy_record(cfg)
    assert rec["strategy"] == "kernels"
    assert rec["required_xla_flags"] == ["--xla_gpu_autotune_level=0"]


def test_kernels_strategy_refuses_a_step_with_scatter(tiny_path):
    """Without XLA's deterministic flag a scatter-add runs with atomics: the lowered step is checked."""
    import jax
    import jax.numpy as jnp

    cfg = load_config(tiny_path, ["determinism.strategy=kernels", "model.kernels=pallas"])
    ids = jnp.arange(8) % 3
    scatter = jax.jit(lambda v: jnp.zeros((3, 4)).at[ids].add(v)).lower(jnp.ones((8, 4))).as_text()
    assert determinism.nondeterministic_ops(scatter) == {"scatter": 1}
    with pytest.raises(determinism.DeterminismError, match=r"scatter x1.*determinism\.strategy=xla_flags"):
        determinism.check_lowered_step(cfg, scatter)
    gather = jax.jit(lambda v: v[ids]).lower(jnp.ones((8, 4))).as_text()
    determinism.check_lowered_step(cfg, gather)  # a gather is fine
    # the xla_flags strategy leaves scatters to XLA's flag
    determinism.check_lowered_step(load_config(tiny_path, []), scatter)
