"""A run's parameters as a Hugging Face transformers checkpoint (`python -m detjax.export RUN OUT --format hf`).

transformers has no class for detjax's block pattern as such, so a pattern is mapped onto the family whose
layers it can be written as exactly:

- **Llama** (`LlamaForCausalLM`): a dense pattern of `*-` pairs. Each detjax attention block and the MLP
  block after it become one Llama layer (the attention block's norm is `input_layernorm`, the MLP block's
  `post_attention_layernorm`).
- **GraniteMoeHybrid** (`GraniteMoeHybridForCausalLM`): any other pattern of (mixer, feed-forward) pairs, the
  mixer `M` (Mamba2) or `*` (attention), the feed-forward `-` (SwiGLU MLP) or `E` (MoE with a shared
  expert), every feed-forward of one kind. Its Mamba2 layer is detjax's (one B/C group, causal conv over x, B,
  C, gated RMSNorm over the whole inner width), its router a softmax over the top-k logits (the same gates as
  detjax's softmax then top-k then normalise), its experts SwiGLU.

Nemotron-H, the family detjax's letters come from, does not fit: its MLP and experts are un-gated squared
ReLU, detjax's are SwiGLU. Patterns with two mixers or two feed-forwards in a row (the default `M*E-`) have
no transformers family and are refused with the first block that does not pair. The MTP head has no
counterpart and is left out with a note; everything else maps weight for weight (transposed to torch's
(out, in) layout), in float32 by default (the masters' bytes) or bfloat16.

The mapping works on the flat {dotted name: array} dict that `detjax.export` writes, so it needs numpy only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MIXERS, FFNS = "M*", "-E"


class ExportError(ValueError):
    """A model that has no transformers counterpart; the message names what does not map."""


@dataclass
class HFCheckpoint:
    config: dict
    tensors: dict[str, np.ndarray]
    notes: list[str] = field(default_factory=list)


def pairs(pattern: str) -> list[tuple[int, int]]:
    """The (mixer, feed-forward) block index pairs of a pattern, or ExportError naming the first block out of
    place."""
    out = []
    for j in range(0, len(pattern), 2):
        m = pattern[j]
        f = pattern[j + 1] if j + 1 < len(pattern) else None
        if m not in MIXERS:
            raise ExportError(
                f"model.pattern {pattern!r}: block {j} is {m!r} where a mixer (M or *) must start a layer; "
                "transformers layers are (mixer, feed-forward) pairs, so the pattern must alternate them (e.g. 'M-*E')"
            )
        if f is None or f not in FFNS:
            what = "the pattern ends" if f is None else f"block {j + 1} is {f!r}"
            raise ExportError(
                f"model.pattern {pattern!r}: {what} where a feed-forward (- or E) must follow mixer {j}; "
                "transformers layers are (mixer, feed-forward) pairs, so the pattern must alternate them (e.g. 'M-*E')"
            )
        out.append((j, j + 1))
    return out


def family(model: dict) -> str:
    """The family, "llama" or "granitemoehybrid", for a model config (the `model` section as a dict), or ExportError."""
    pattern = model["pattern"]
    pp = pairs(pattern)
    if all(pattern[a] == "*" and pattern[b] == "-" for a, b in pp):
        return "llama"
    ffn = {pattern[b] for _, b in pp}
    if len(ffn) > 1:
        raise ExportError(
            f"model.pattern {pattern!r} mixes MLP (-) and MoE (E) feed-forwards; GraniteMoeHybrid, the transformers "
            "family of Mamba2/attention hybrids, gives every layer the same feed-forward"
        )
    if "*" in pattern and model["n_heads"] * model["head_dim"] != model["d_model"]:
        raise ExportError(
            f"n_heads x head_dim = {model['n_heads'] * model['head_dim']} is not d_model = {model['d_model']}; "
            "GraniteMoeHybrid's attention takes head_dim = d_model / n_heads"
        )
    if "E" in ffn:
        moe = model["moe"]
        if moe["router"] != "softmax":
            raise ExportError(
                f"model.moe.router {moe['router']!r}: GraniteMoeHybrid routes by a softmax over the top-k logits; "
                "only detjax's softmax router maps onto it"
            )
        if not moe["shared_expert"]:
            raise ExportError("model.moe.shared_expert is off: GraniteMoeHybrid's MoE layers always add a shared MLP")
    return "granitemoehybrid"


def _linear(w_in_out: np.ndarray) -> np.ndarray:
    """A detjax (in..., out...) weight flattened to (in, out) and transposed to torch's (out, in)."""
    return np.ascontiguousarray(w_in_out.T)


def _attention(t: dict, pre: str, out: str) -> dict[str, np.ndarray]:
    w_q, w_k, w_v, w_o = (t[f"{pre}.mixer.{n}"] for n in ("w_q", "w_k", "w_v", "w_o"))
    d = w_q.shape[0]
    return {
        f"{out}.q_proj.weight": _linear(w_q.reshape(d, -1)),
        f"{out}.k_proj.weight": _linear(w_k.reshape(d, -1)),
        f"{out}.v_proj.weight": _linear(w_v.reshape(d, -1)),
        f"{out}.o_proj.weight": _linear(w_o.reshape(-1, d)),
    }


def _mamba(t: dict, pre: str, out: str) -> dict[str, np.ndarray]:
    g = lambda n: t[f"{pre}.mixer.{n}"]  # noqa: E731
    d = g("w_in_z").shape[0]
    width = g("w_conv_x").shape[0]
    # in_proj's rows: gate z, then the conv's channels x, B, C, then dt (transformers' split order)
    w_in = np.concatenate(
        [g("w_in_z").reshape(d, -1), g("w_in_x").reshape(d, -1), g("w_in_bc").reshape(d, -1), g("w_in_dt")], axis=1
    )
    w_conv = np.concatenate([g("w_conv_x").reshape(width, -1), g("w_conv_bc").reshape(width, -1)], axis=1)
    return {
        f"{out}.in_proj.weight": _linear(w_in),
        f"{out}.conv1d.weight": np.ascontiguousarray(w_conv.T[:, None, :]),  # (channels, 1, width)
        f"{out}.conv1d.bias": np.concatenate([g("b_conv_x").reshape(-1), g("b_conv_bc").reshape(-1)]),
        f"{out}.dt_bias": g("dt_bias"),
        f"{out}.A_log": g("a_log"),
        f"{out}.D": g("d_skip"),
        f"{out}.norm.weight": g("norm_scale").reshape(-1),
        f"{out}.out_proj.weight": _linear(g("w_out").reshape(-1, d)),
    }


def _gated(t: dict, pre: str) -> np.ndarray:
    """SwiGLU gate and up as one (2F, D) matrix, gate first (transformers' chunk(2) order)."""
    return np.concatenate([_linear(t[f"{pre}.w_gate"]), _linear(t[f"{pre}.w_up"])], axis=0)


def _llama(model: dict, t: dict) -> HFCheckpoint:
    out = {"model.embed_tokens.weight": t["embed.table"], "model.norm.weight": t["final_norm.scale"]}
    out["lm_head.weight"] = _linear(t["w_head"])
    for j, (a, m) in enumerate(pairs(model["pattern"])):
        lay = f"model.layers.{j}"
        out[f"{lay}.input_layernorm.weight"] = t[f"layer_{a}.norm.scale"]
        out.update(_attention(t, f"layer_{a}", f"{lay}.self_attn"))
        out[f"{lay}.post_attention_layernorm.weight"] = t[f"layer_{m}.norm.scale"]
        for n in ("gate", "up", "down"):
            out[f"{lay}.mlp.{n}_proj.weight"] = _linear(t[f"layer_{m}.mixer.w_{n}"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model["d_model"],
        "intermediate_size": model["ffn_dim"],
        "num_hidden_layers": len(model["pattern"]) // 2,
        "num_attention_heads": model["n_heads"],
        "num_key_value_heads": model["n_kv_heads"],
        "head_dim": model["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": model["norm_eps"],
        "rope_parameters": {"rope_type": "default", "rope_theta": model["rope_theta"]},
        "rope_theta": model["rope_theta"],
        "attention_bias": False,
        "mlp_bias": False,
    }
    return HFCheckpoint(config, out)


def _granite(model: dict, t: dict) -> HFCheckpoint:
    pattern, moe, mamba = model["pattern"], model["moe"], model["mamba"]
    experts = "E" in pattern
    out = {"model.embed_tokens.weight": t["embed.table"], "model.norm.weight": t["final_norm.scale"]}
    out["lm_head.weight"] = _linear(t["w_head"])
    kinds = []
    for j, (a, f) in enumerate(pairs(pattern)):
        lay = f"model.layers.{j}"
        out[f"{lay}.input_layernorm.weight"] = t[f"layer_{a}.norm.scale"]
        if pattern[a] == "M":
            kinds.append("linear_attention")
            out.update(_mamba(t, f"layer_{a}", f"{lay}.mamba"))
        else:
            kinds.append("full_attention")
            out.update(_attention(t, f"layer_{a}", f"{lay}.self_attn"))
        out[f"{lay}.post_attention_layernorm.weight"] = t[f"layer_{f}.norm.scale"]
        mlp = f"layer_{f}.mixer.shared" if experts else f"layer_{f}.mixer"
        out[f"{lay}.shared_mlp.input_linear.weight"] = _gated(t, mlp)
        out[f"{lay}.shared_mlp.output_linear.weight"] = _linear(t[f"{mlp}.w_down"])
        if experts:
            e = f"layer_{f}.mixer.experts"
            moe_pre = f"{lay}.block_sparse_moe"
            out[f"{moe_pre}.router.weight"] = _linear(t[f"layer_{f}.mixer.w_router"])
            gate_up = np.concatenate([t[f"{e}.w_gate"], t[f"{e}.w_up"]], axis=2)  # (E, D, 2F)
            out[f"{moe_pre}.experts.gate_up_proj"] = np.ascontiguousarray(gate_up.transpose(0, 2, 1))
            out[f"{moe_pre}.experts.down_proj"] = np.ascontiguousarray(t[f"{e}.w_down"].transpose(0, 2, 1))
    d, d_inner = model["d_model"], mamba["expand"] * model["d_model"]
    config = {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "hidden_size": d,
        "intermediate_size": moe["ffn_dim"] if experts else model["ffn_dim"],
        "shared_intermediate_size": moe["ffn_dim"] if experts else model["ffn_dim"],
        "num_local_experts": moe["n_experts"] if experts else 0,
        "num_experts_per_tok": moe["top_k"] if experts else 0,
        "num_hidden_layers": len(kinds),
        "layer_types": kinds,
        "num_attention_heads": model["n_heads"],
        "num_key_value_heads": model["n_kv_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": model["norm_eps"],
        "position_embedding_type": "rope",
        "rope_parameters": {"rope_type": "default", "rope_theta": model["rope_theta"]},
        "attention_multiplier": model["head_dim"] ** -0.5,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "logits_scaling": 1.0,
        "attention_bias": False,
        "mamba_n_heads": mamba["n_heads"],
        "mamba_n_groups": 1,
        "mamba_d_state": mamba["d_state"],
        "mamba_d_head": d_inner // mamba["n_heads"],
        "mamba_d_conv": mamba["d_conv"],
        "mamba_expand": mamba["expand"],
        "mamba_chunk_size": mamba["chunk_size"],
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
    }
    return HFCheckpoint(config, out)


def convert(model: dict, tensors: dict[str, np.ndarray], seq_len: int) -> HFCheckpoint:
    """detjax's flat tensors (export.tensor_name -> array) as a transformers checkpoint of `family(model)`."""
    fam = family(model)
    ck = (_llama if fam == "llama" else _granite)(model, tensors)
    ck.config.update(
        vocab_size=model["vocab_size"],
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
        initializer_range=model["init_std"],
        torch_dtype="float32",
    )
    if model["mtp"]["depth"]:
        ck.notes.append("the MTP head (mtp_*, w_mtp_proj) has no transformers counterpart and was left out")
    used = _consumed(model)
    left = sorted(n for n in tensors if n not in used and not n.startswith(("mtp_", "w_mtp")))
    if left:  # a parameter the mapping did not place: refuse rather than write a model missing it
        raise ExportError(f"parameters with no place in the {fam} checkpoint: {', '.join(left[:6])}")
    return ck


def _consumed(model: dict) -> set[str]:
    """The detjax tensor names the mapping reads (to catch a parameter it would silently drop)."""
    names = {"embed.table", "final_norm.scale", "w_head"}
    per = {
        "*": ("w_q", "w_k", "w_v", "w_o"),
        "M": tuple(
            "w_in_z w_in_x w_in_bc w_in_dt w_conv_x b_conv_x w_conv_bc b_conv_bc dt_bias a_log d_skip norm_scale "
            "w_out".split()
        ),
        "-": ("w_gate", "w_up", "w_down"),
        "E": ("w_router", "shared.w_gate", "shared.w_up", "shared.w_down")
        + ("experts.w_gate", "experts.w_up", "experts.w_down"),
    }
    for i, letter in enumerate(model["pattern"]):
        names.add(f"layer_{i}.norm.scale")
        names.update(f"layer_{i}.mixer.{n}" for n in per[letter])
    return names


# --------------------------------------------------------------------------- tokenizer files


def byte_tokenizer_json() -> str:
    """detjax's byte tokenizer (ids 0-255 the bytes, 256 BOS, 257 EOS, 258 PAD) as a `tokenizers` JSON: a
    byte-level BPE with the 256 byte symbols in byte order and no merges, so every text encodes to its UTF-8
    bytes, as detjax's own encoder does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from detjax.data.tokenizer import BOS, EOS, PAD

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    char_of = _bytes_to_unicode()
    vocab = {char_of[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet), "tokenizers' byte-level alphabet is not the 256 byte symbols"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in ("<|bos|>", "<|eos|>", "<|pad|>")])
    got = [tok.token_to_id(s) for s in ("<|bos|>", "<|eos|>", "<|pad|>")]
    assert got == [BOS, EOS, PAD], got
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which tokenizers' ByteLevel uses."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_tokenizer(out: Path, tok) -> dict[str, int | None]:
    """tokenizer.json and tokenizer_config.json for `tok` (detjax.data.tokenizer); returns the special ids."""
    text = byte_tokenizer_json() if tok.kind == "bytes" else tok.to_json()
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    from tokenizers import Tokenizer

    t = Tokenizer.from_str(text)
    name = lambda i: None if i is None else t.id_to_token(i)  # noqa: E731
    tc = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": name(tok.eos_id),
        "bos_token": name(tok.bos_id),
        "pad_token": name(tok.pad_id),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tc.items() if v is not None}, indent=2))
    return {"eos_token_id": tok.eos_id, "bos_token_id": tok.bos_id, "pad_token_id": tok.pad_id}
