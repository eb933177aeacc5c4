"""`python -m detjax.export RUN OUT --format hf`: the checkpoint transformers loads gives detjax's logits.

The mapping and its refusals need numpy only and run everywhere. The logits tests need torch and transformers
(`pip install -e '.[hf]'`) and are skipped without them: a tiny model of each family (Llama for a dense `*-`
pattern; GraniteMoeHybrid with Mamba2 and attention, with MLP and with MoE feed-forwards), every parameter
randomised (norm scales, dt bias and skip included, so a misplaced vector shows), run through detjax's forward
in float32 and through the exported checkpoint in transformers on the CPU. A permuted weight is the negative
control: the same comparison fails on it.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detjax.config import load_config
from detjax.data.tokenizer import ByteTokenizer
from detjax.export import main as export_main
from detjax.export import tensor_name
from detjax.export_hf import ExportError, byte_tokenizer_json, convert, family, layers

LENGTH = 32  # a multiple of the tiny Mamba2 chunk (16)


def tiny_cfg(pattern: str, *extra: str):
    overrides = [f"model.pattern={pattern}", "model.compute_dtype=float32", "model.dropout=0.0"]
    return load_config("configs/tiny.yaml", [*overrides, f"train.seq_len={LENGTH}", *extra])


def random_params(cfg, seed: int = 0) -> dict:
    """The model's parameters with every leaf drawn at random (vectors around their init, not constant)."""
    from flax import linen as nn

    from detjax.model.lm import HybridLM

    params = nn.meta.unbox(HybridLM(cfg.model).init(jax.random.key(seed), jnp.zeros((1, LENGTH), jnp.int32))["params"])
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    out = []
    for x in leaves:
        x = np.asarray(x)
        noise = rng.standard_normal(x.shape).astype(np.float32)
        out.append(x + 0.1 * noise if x.ndim <= 2 and x.size < 4096 else x * (1 + 0.1 * noise))
    return jax.tree.unflatten(tree, [jnp.asarray(x) for x in out])


def flat(params) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {tensor_name(jax.tree_util.keystr(p)): np.asarray(x) for p, x in leaves}


# --------------------------------------------------------------------------- mapping and refusals (numpy only)


def test_layers_and_families():
    assert layers("M-*E") == [(0, 1), (2, 3)]
    assert layers("M*E-", pad=True) == [(0, None), (1, 2), (None, 3)]
    assert layers("-M", pad=True) == [(None, 0), (1, None)]
    assert family(tiny_cfg("*-*-").to_dict()["model"]) == "llama"
    assert family(tiny_cfg("M-*-").to_dict()["model"]) == "granitemoehybrid"
    assert family(tiny_cfg("ME*E").to_dict()["model"]) == "granitemoehybrid"
    assert family(tiny_cfg("**--").to_dict()["model"], pad=True) == "granitemoehybrid"


@pytest.mark.parametrize(
    ("pattern", "extra", "needle"),
    [
        ("M*E-", (), "block 1 is '*' where a feed-forward (- or E) must follow mixer 0; transformers layers"),
        ("-*-*", (), "block 0 is '-' where a mixer"),
        ("M-*", (), "the pattern ends"),
        ("M-*E", (), "mixes MLP (-) and MoE (E)"),
        ("ME*E", ("model.moe.router=sigmoid",), "router 'sigmoid'"),
        ("ME*E", ("model.moe.shared_expert=false",), "shared_expert is off"),
    ],
)
def test_what_does_not_map_is_refused_by_name(pattern, extra, needle):
    cfg = tiny_cfg(pattern, *extra)
    with pytest.raises(ExportError, match=None) as e:
        convert(cfg.to_dict()["model"], flat(random_params(cfg)), LENGTH)
    assert needle in str(e.value)


def test_every_parameter_is_placed_once():
    """Each detjax parameter lands in the checkpoint (the MTP head excepted, with a note), and the element count
    is the same on both sides."""
    cfg = tiny_cfg("ME*E")
    t = flat(random_params(cfg))
    ck = convert(cfg.to_dict()["model"], t, LENGTH)
    kept = sum(v.size for k, v in t.items() if not k.startswith(("mtp_", "w_mtp")))
    assert sum(v.size for v in ck.tensors.values()) == kept
    assert ck.notes and "MTP" in ck.notes[0]


def test_byte_tokenizer_json_encodes_bytes():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(byte_tokenizer_json())
    for text in ("The cat sat.", "héllo wörld ☃\n\t  x", ""):
        assert tok.encode(text, add_special_tokens=False).ids == list(ByteTokenizer().encode(text, eos=False))
        assert tok.decode(list(ByteTokenizer().encode(text, eos=False))) == text


def test_cli_refuses_the_default_pattern(tmp_path, capsys):
    run = write_run(tmp_path / "run", tiny_cfg("M*E-"))
    assert export_main([str(run), str(tmp_path / "hf"), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot export as a transformers checkpoint: model.pattern 'M*E-'")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "hf").exists()


def write_run(run, cfg, seed: int = 0):
    """A run directory as the trainer leaves one: config.yaml and final_params.npz."""
    from detjax.config import dump_config
    from detjax.rundir import flat_params

    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(cfg))
    np.savez(run / "final_params.npz", **flat_params(random_params(cfg, seed)))
    return run


# --------------------------------------------------------------------------- logits in transformers


@pytest.mark.parametrize(
    ("pattern", "extra"),
    [
        ("*-*-", ()),
        ("M-*-", ()),
        ("ME*E", ()),
        ("M*E-", ("--pad-layers",)),  # the default tiny pattern: zero-weight partners, MLP padded to one width
        ("M*EM*E-", ("--pad-layers",)),  # gpu_medium's unit
    ],
)
def test_exported_logits_match_in_transformers(pattern, extra, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from detjax.model.lm import HybridLM

    cfg = tiny_cfg(pattern)
    run = write_run(tmp_path / "run", cfg, seed=3)
    out = tmp_path / "hf"
    assert export_main([str(run), str(out), "--format", "hf", *extra]) == 0
    assert ("--pad-layers:" in capsys.readouterr().out) == bool(extra)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [{"*-*-": "LlamaForCausalLM"}.get(pattern, "GraniteMoeHybridForCausalLM")]

    ids = np.random.default_rng(1).integers(0, 259, (2, LENGTH)).astype(np.int32)
    params = random_params(cfg, 3)
    want = np.asarray(HybridLM(cfg.model).apply({"params": params}, jnp.asarray(ids))[0])

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()

    def hf_logits(m):
        with torch.no_grad():
            return m(torch.tensor(ids, dtype=torch.long)).logits.numpy()

    got = hf_logits(model)
    scale = np.abs(want).max()
    assert got.shape == want.shape and scale > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)

    # negative control: the first and last query heads (of different kv groups) swapped in the first attention
    # layer's q_proj: the same comparison must fail
    layer = next(j for j, (a, _) in enumerate(layers(pattern, bool(extra))) if a is not None and pattern[a] == "*")
    q = model.model.layers[layer].self_attn.q_proj.weight
    hd, last = cfg.model.head_dim, (cfg.model.n_heads - 1) * cfg.model.head_dim
    with torch.no_grad():
        q[:hd], q[last:] = q[last:].clone(), q[:hd].clone()
    assert np.abs(hf_logits(model) - want).max() > 10 * 2e-5 * scale

    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "The cat sat on the mat. ☃"
    assert tok(text)["input_ids"] == list(ByteTokenizer().encode(text, eos=False))
    assert tok.eos_token_id == ByteTokenizer.eos_id


def test_bfloat16_export_loads_with_rounded_weights(tmp_path):
    """`--dtype bfloat16`: the tensors are the float32 masters rounded to bfloat16 (ml_dtypes' round to nearest
    even), and transformers loads them as bfloat16 parameters."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import ml_dtypes

    from detjax.export import read_safetensors

    cfg = tiny_cfg("*-*-")
    run = write_run(tmp_path / "run", cfg, seed=4)
    out = tmp_path / "hf"
    assert export_main([str(run), str(out), "--format", "hf", "--dtype", "bfloat16"]) == 0
    got, _ = read_safetensors(out / "model.safetensors")
    table = flat(random_params(cfg, 4))["embed.table"]
    assert got["model.embed_tokens.weight"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert got["model.embed_tokens.weight"].tobytes() == table.astype(ml_dtypes.bfloat16).tobytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
