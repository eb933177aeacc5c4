"""`python -m detjax.sample RUN --prompt TEXT [--max-new N] [--top-k K] [--temperature T] [--seed S]`: text
from a trained run.

Loads the run's resolved config (RUN/config.yaml) and its parameters (RUN/final_params.npz, or with --step or
when the run has no final params, a checkpoint through the checked restore), then decodes with the byte
tokenizer: greedy (--top-k 0, the default) or top-k sampling at a temperature. There is no KV cache: every
new token re-runs the whole context, in one fixed-length buffer (train.seq_len) so the forward compiles once;
every block is causal and the MoE is dropless, so the padding after the current position does not reach its
logits. The sampling key of position p is fold_in(key(seed), p): the same seed gives the same text. A run
trained with model.fp8 samples with its projections in the compute dtype (bf16), not in fp8.
Exit 0, or 2 on bad input (no such run, no parameters, a prompt longer than the buffer).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path


class SampleError(ValueError):
    pass


def run_config(run: Path):
    """The resolved config a run wrote, with its XLA flags set before JAX starts; None (error printed) when
    `run` is not a run directory or its config does not load."""
    if not (run / "config.yaml").is_file():
        print(
            f"error: {run} is not a run directory (no config.yaml). Fix: pass a directory a run wrote", file=sys.stderr
        )
        return None
    from detjax.train import config_for_cli

    return config_for_cli(str(run / "config.yaml"), [])


def load_params(run: Path, cfg, step: int | None):
    """The run's parameters as the model's pytree: final_params.npz, or checkpoint `step` (default: latest)."""
    import jax
    import numpy as np

    from detjax.step import Trainer

    trainer = Trainer(cfg)
    abstract = trainer.abstract_state()
    final = run / "final_params.npz"
    if step is None and final.is_file():
        flat = np.load(final)
        paths = jax.tree_util.tree_flatten_with_path(abstract.params)[0]
        missing = [jax.tree_util.keystr(p) for p, _ in paths if jax.tree_util.keystr(p) not in flat.files]
        if missing:
            raise SampleError(
                f"{final} lacks {missing[0]} (and {len(missing) - 1} more). Fix: pass the run that wrote it"
            )
        leaves = [np.asarray(flat[jax.tree_util.keystr(p)]) for p, _ in paths]
        return jax.tree.unflatten(jax.tree.structure(abstract.params), leaves)
    from detjax.ckpt import Checkpointer, CheckpointError
    from detjax.sharding.mesh import replicated, single_device_mesh

    if not (run / "checkpoints").is_dir():
        raise SampleError(f"{run} holds neither final_params.npz nor checkpoints/. Fix: pass a finished run or --step")
    ck = Checkpointer(run / "checkpoints", cfg)
    try:
        rep = jax.tree.map(lambda _: replicated(single_device_mesh()), abstract)
        state, _, _ = ck.restore(abstract, rep, step)
    except CheckpointError as e:
        raise SampleError(str(e)) from None
    finally:
        ck.close()
    return state.params


def run_tokenizer(cfg):
    """The tokenizer the run's data was written with: the byte tokenizer for the builtin corpus, else the one
    in the prepared corpus's directory (checked against its meta.json and the run's data.tokenizer_sha256)."""
    from detjax.data import tokenizer as tk

    if cfg.data.source != "arrayrecord":
        return tk.ByteTokenizer()
    from detjax.data.pipeline import DataError, read_meta

    try:
        meta = read_meta(cfg.data.path)
        tok = tk.from_meta(meta, Path(meta["dir"]))
    except (DataError, tk.TokenizerError) as e:
        raise SampleError(f"cannot load the run's tokenizer: {e}") from None
    if cfg.data.tokenizer_sha256 and tok.sha256 != cfg.data.tokenizer_sha256:
        raise SampleError(f"{meta['dir']} now holds another tokenizer than the run was trained with")
    return tok


def generate(cfg, params, prompt_ids, max_new: int, top_k: int, temperature: float, seed: int, tok=None) -> list[int]:
    """Token ids after the prompt (stops at EOS, after max_new tokens, or when the buffer is full)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from detjax.data.tokenizer import ByteTokenizer
    from detjax.model.lm import HybridLM

    tok = tok or ByteTokenizer()
    eos, pad = tok.eos_id, tok.eos_id if tok.pad_id is None else tok.pad_id

    length = cfg.train.seq_len
    n = len(prompt_ids)
    if not 0 < n < length:
        raise SampleError(f"the prompt has {n} tokens; it must have 1..{length - 1} (train.seq_len = {length})")
    # fp8 (model.fp8) is a training recipe: sampling runs the same weights' projections in the compute dtype
    model = HybridLM(dataclasses.replace(cfg.model, fp8=dataclasses.replace(cfg.model.fp8, enabled=False)))
    valid = jnp.arange(cfg.model.vocab_size) < tok.vocab_size  # ids the tokenizer can produce

    @jax.jit
    def next_token(params, buf_1L, pos, key):
        logits = model.apply({"params": params}, buf_1L, train=False)[0][0, pos - 1].astype(jnp.float32)
        logits = jnp.where(valid, logits, -jnp.inf)
        if top_k <= 0:
            return jnp.argmax(logits)
        vals, idx = jax.lax.top_k(logits, top_k)
        return idx[jax.random.categorical(jax.random.fold_in(key, pos), vals / temperature)]

    buf = np.full((1, length), pad, np.int32)
    buf[0, :n] = prompt_ids
    key = jax.random.key(seed)
    out: list[int] = []
    for pos in range(n, min(length, n + max_new)):
        nxt = int(next_token(params, jnp.asarray(buf), pos, key))
        out.append(nxt)
        if nxt == eos:
            break
        buf[0, pos] = nxt
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m detjax.sample", description="Text from a trained detjax run.")
    ap.add_argument("run", help="a run directory (config.yaml + final_params.npz or checkpoints/)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new", type=int, default=64, help="new tokens at most (default 64)")
    ap.add_argument("--top-k", type=int, default=0, help="0: greedy (default); K > 0: sample from the K likeliest")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step", type=int, default=None, help="use checkpoint step N instead of the final params")
    args = ap.parse_args(argv)
    run = Path(args.run)
    if args.temperature <= 0 or args.top_k < 0 or args.max_new < 1:
        print("error: need --temperature > 0, --top-k >= 0 and --max-new >= 1", file=sys.stderr)
        return 2
    cfg = run_config(run)
    if cfg is None:
        return 2
    try:
        tok = run_tokenizer(cfg)
        params = load_params(run, cfg, args.step)
        prompt = tok.encode(args.prompt, eos=False)
        ids = generate(cfg, params, prompt, args.max_new, args.top_k, args.temperature, args.seed, tok)
    except SampleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(args.prompt + tok.decode(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
