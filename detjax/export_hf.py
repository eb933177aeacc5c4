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
ReLU, detjax's are SwiGLU. A pattern with two mixers or two feed-forwards in a row (the default `M*E-`, the
gpu_medium pattern), or with both MLP and MoE feed-forwards, is not a sequence of GraniteMoeHybrid layers as
it stands: it is refused with the first block that does not pair, unless `pad` (`--pad-layers`) gives every
block without a partner a partner of zero weights (an attention, an MLP or a MoE of zeros adds exactly zero
to the residual stream) and pads narrower MLPs with zero units to the one shared width. The function is the
same; the checkpoint is larger and transformers spends compute on the zero parts. The MTP head has no
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


PAIR_HINT = "transformers layers are (mixer, feed-forward) pairs: alternate them (e.g. 'M-*E') or pass --pad-layers"


def layers(pattern: str, pad: bool = False) -> list[tuple[int | None, int | None]]:
    """The pattern as transformers layers: (mixer block, feed-forward block) index pairs, a mixer M or * followed
    by a feed-forward - or E. With `pad`, a block without a partner gets None there (a zero-weight partner in
    the checkpoint); without it, ExportError names the first block out of place."""
    out: list[tuple[int | None, int | None]] = []
    i = 0
    while i < len(pattern):
        nxt = pattern[i + 1] if i + 1 < len(pattern) else None
        if pattern[i] in MIXERS and nxt is not None and nxt in FFNS:
            out.append((i, i + 1))
            i += 2
            continue
        if not pad:
            if pattern[i] in FFNS:
                why = f"block {i} is {pattern[i]!r} where a mixer (M or *) must start a layer"
            else:
                what = "the pattern ends" if nxt is None else f"block {i + 1} is {nxt!r}"
                why = f"{what} where a feed-forward (- or E) must follow mixer {i}"
            raise ExportError(f"model.pattern {pattern!r}: {why}; {PAIR_HINT}")
        out.append((i, None) if pattern[i] in MIXERS else (None, i))
        i += 1
    return out


def family(model: dict, pad: bool = False) -> str:
    """The family, "llama" or "granitemoehybrid", for a model config (the `model` section as a dict), or
    ExportError."""
    pattern = model["pattern"]
    lays = layers(pattern, pad)
    if all(a is not None and b is not None and pattern[a] == "*" and pattern[b] == "-" for a, b in lays):
        return "llama"
    ffn = {pattern[b] for _, b in lays if b is not None}
    if len(ffn) > 1 and not pad:
        raise ExportError(
            f"model.pattern {pattern!r} mixes MLP (-) and MoE (E) feed-forwards; GraniteMoeHybrid, the transformers "
            "family of Mamba2/attention hybrids, gives every layer the same feed-forward. Pass --pad-layers to give "
            "the MLP layers a zero-weight MoE"
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
        if not moe["shared_expert"] and not pad:
            raise ExportError(
                "model.moe.shared_expert is off: GraniteMoeHybrid's MoE layers always add a shared MLP. Pass "
                "--pad-layers to give them a zero-weight one"
            )
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


def _shared_mlp(t: dict, pre: str | None, d: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A SwiGLU MLP as GraniteMoeHybrid's shared MLP of `width`: gate and up as one (2 width, D) matrix, gate
    first (transformers' chunk(2) order), and the down product (D, width). A narrower MLP is padded with
    zero units (silu(0) x 0 = 0: they add nothing); `pre` None is an MLP of zeros."""
    gate, up, down = (np.zeros((width, d), np.float32) for _ in range(3))
    if pre is not None:
        f = t[f"{pre}.w_gate"].shape[1]
        gate[:f], up[:f], down[:f] = _linear(t[f"{pre}.w_gate"]), _linear(t[f"{pre}.w_up"]), t[f"{pre}.w_down"]
    return np.concatenate([gate, up], axis=0), np.ascontiguousarray(down.T)


def _llama(model: dict, t: dict) -> HFCheckpoint:
    out = {"model.embed_tokens.weight": t["embed.table"], "model.norm.weight": t["final_norm.scale"]}
    out["lm_head.weight"] = _linear(t["w_head"])
    for j, (a, m) in enumerate(layers(model["pattern"])):
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
        "num_hidden_layers": len(layers(model["pattern"])),
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


def _granite(model: dict, t: dict, pad: bool) -> HFCheckpoint:
    pattern, moe, mamba = model["pattern"], model["moe"], model["mamba"]
    d, d_inner = model["d_model"], mamba["expand"] * model["d_model"]
    lays = layers(pattern, pad)
    experts = "E" in pattern
    widths = [model["ffn_dim"] if pattern[f] == "-" else moe["ffn_dim"] for _, f in lays if f is not None]
    width = max(widths, default=model["ffn_dim"])  # the shared MLP's width: one for all layers
    out = {"model.embed_tokens.weight": t["embed.table"], "model.norm.weight": t["final_norm.scale"]}
    out["lm_head.weight"] = _linear(t["w_head"])
    kinds, padded = [], 0
    hd = d // model["n_heads"]  # GraniteMoeHybrid's head_dim (equal to model.head_dim where `*` blocks exist)
    for j, (a, f) in enumerate(lays):
        lay = f"model.layers.{j}"
        out[f"{lay}.input_layernorm.weight"] = np.ones(d, np.float32) if a is None else t[f"layer_{a}.norm.scale"]
        if a is not None and pattern[a] == "M":
            kinds.append("linear_attention")
            out.update(_mamba(t, f"layer_{a}", f"{lay}.mamba"))
        elif a is not None:
            kinds.append("full_attention")
            out.update(_attention(t, f"layer_{a}", f"{lay}.self_attn"))
        else:  # an attention of zeros: softmax over zero scores times zero values, then a zero product: exactly 0
            kinds.append("full_attention")
            h, k = model["n_heads"], model["n_kv_heads"]
            for n, shape in (("q", (h * hd, d)), ("k", (k * hd, d)), ("v", (k * hd, d)), ("o", (d, h * hd))):
                out[f"{lay}.self_attn.{n}_proj.weight"] = np.zeros(shape, np.float32)
        out[f"{lay}.post_attention_layernorm.weight"] = (
            np.ones(d, np.float32) if f is None else t[f"layer_{f}.norm.scale"]
        )
        routed = f is not None and pattern[f] == "E"
        mlp = None if f is None else (f"layer_{f}.mixer" if pattern[f] == "-" else f"layer_{f}.mixer.shared")
        if routed and not moe["shared_expert"]:
            mlp = None
        gate_up, down = _shared_mlp(t, mlp, d, width)
        out[f"{lay}.shared_mlp.input_linear.weight"], out[f"{lay}.shared_mlp.output_linear.weight"] = gate_up, down
        if experts:  # every layer has the MoE; one that is not an E block gets zero experts (they add 0)
            pre, e, fm = f"{lay}.block_sparse_moe", moe["n_experts"], moe["ffn_dim"]
            if routed:
                ex = f"layer_{f}.mixer.experts"
                out[f"{pre}.router.weight"] = _linear(t[f"layer_{f}.mixer.w_router"])
                gate_up = np.concatenate([t[f"{ex}.w_gate"], t[f"{ex}.w_up"]], axis=2)  # (E, D, 2F)
                out[f"{pre}.experts.gate_up_proj"] = np.ascontiguousarray(gate_up.transpose(0, 2, 1))
                out[f"{pre}.experts.down_proj"] = np.ascontiguousarray(t[f"{ex}.w_down"].transpose(0, 2, 1))
            else:
                out[f"{pre}.router.weight"] = np.zeros((e, d), np.float32)
                out[f"{pre}.experts.gate_up_proj"] = np.zeros((e, 2 * fm, d), np.float32)
                out[f"{pre}.experts.down_proj"] = np.zeros((e, d, fm), np.float32)
        padded += (a is None) + (mlp is None) + (f is not None and not routed and experts)
    config = {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "hidden_size": d,
        "intermediate_size": moe["ffn_dim"] if experts else width,
        "shared_intermediate_size": width,
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
    ck = HFCheckpoint(config, out)
    if padded or any(w < width for w in widths):
        ck.notes.append(
            f"--pad-layers: {len(kinds)} transformers layers for {len(pattern)} blocks; {padded} zero-weight parts "
            "(an attention, MLP or MoE of zeros adds exactly 0 to the residual stream) and MLPs padded with zero "
            f"units to width {width}: the same function, a larger checkpoint"
        )
    return ck


def convert(model: dict, tensors: dict[str, np.ndarray], seq_len: int, pad: bool = False) -> HFCheckpoint:
    """detjax's flat tensors (export.tensor_name -> array) as a transformers checkpoint of `family(model, pad)`."""
    fam = family(model, pad)
    ck = _llama(model, tensors) if fam == "llama" else _granite(model, tensors, pad)
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
