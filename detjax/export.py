"""`python -m detjax.export RUN OUT [--format detjax|hf] [--step N]`: a run's parameters as safetensors.

`--format hf` writes a Hugging Face transformers checkpoint directory instead (config.json, model.safetensors,
tokenizer files) that `AutoModelForCausalLM.from_pretrained(OUT)` loads: Llama for a dense `*-` pattern,
GraniteMoeHybrid for Mamba2/attention hybrids in (mixer, feed-forward) pairs (detjax.export_hf says what maps
and what is refused). The rest of this docstring is about the default format.

Tensor names are the parameter paths with dots: `['layer_0']['mixer']['w_qkv']` becomes `layer_0.mixer.w_qkv`
(`python -m detjax.export RUN OUT --list` prints them with shapes and dtypes). Values are the fp32 masters,
byte for byte. The file's `__metadata__` holds the run's config hash and the model config as JSON, so the
tensors can be matched with the code that reads them. The format (an 8-byte little-endian header length, a
JSON header of name -> dtype, shape, byte offsets, then the raw little-endian bytes) is written here with
numpy, so exporting needs no extra package; any safetensors reader (e.g. `safetensors.numpy.load_file`)
reads it.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np

DTYPES = {
    np.dtype("float32"): "F32",
    np.dtype("float16"): "F16",
    np.dtype("float64"): "F64",
    np.dtype("int32"): "I32",
    np.dtype("int64"): "I64",
    np.dtype("uint32"): "U32",
    np.dtype("uint8"): "U8",
    np.dtype("int8"): "I8",
    np.dtype("bool"): "BOOL",
}
try:  # bfloat16 comes with JAX (ml_dtypes); `--dtype bfloat16` needs it
    import ml_dtypes

    DTYPES[np.dtype(ml_dtypes.bfloat16)] = "BF16"
except ImportError:  # pragma: no cover - JAX always brings it
    pass
_FROM = {v: k for k, v in DTYPES.items()}


def tensor_name(path: str) -> str:
    """`['layer_0']['mixer']['w']` -> `layer_0.mixer.w` (the keystr of a parameter path)."""
    parts = re.findall(r"\['([^']*)'\]|\[(\d+)\]", path)
    return ".".join(a or b for a, b in parts) if parts else path


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {a.dtype} has no safetensors name")
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        header[name] = {"dtype": DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())
    tmp.replace(path)


def read_safetensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, h in header.items():
        lo, hi = h["data_offsets"]
        out[name] = np.frombuffer(data[base + lo : base + hi], dtype=_FROM[h["dtype"]]).reshape(h["shape"])
    return out, meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m detjax.export", description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("run", help="a run directory (config.yaml + final_params.npz or checkpoints/)")
    ap.add_argument("out", help="the .safetensors file to write (--format hf: the directory to write)")
    ap.add_argument("--format", choices=("detjax", "hf"), default="detjax", help="detjax's names, or transformers'")
    ap.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="--format hf: the weights' dtype"
    )
    ap.add_argument(
        "--pad-layers",
        action="store_true",
        help="--format hf: give blocks without a (mixer, feed-forward) partner a zero-weight one (detjax.export_hf)",
    )
    ap.add_argument("--step", type=int, default=None, help="export checkpoint step N instead of the final params")
    ap.add_argument("--list", action="store_true", help="print each tensor's name, shape and dtype")
    args = ap.parse_args(argv)
    from detjax.sample import SampleError, load_params, run_config

    run = Path(args.run)
    cfg = run_config(run)
    if cfg is None:
        return 2
    import jax

    try:
        params = load_params(run, cfg, args.step)
    except SampleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tensors = {
        tensor_name(jax.tree_util.keystr(p)): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    if args.format == "hf":
        return _export_hf(cfg, tensors, Path(args.out), args.dtype, args.list, args.pad_layers)
    meta = {"config_hash": cfg.hash(), "model": json.dumps(cfg.to_dict()["model"], sort_keys=True), "format": "detjax"}
    write_safetensors(args.out, tensors, meta)
    _report(tensors, args.out, args.list)
    return 0


def _report(tensors: dict[str, np.ndarray], out, listing: bool) -> None:
    if listing:
        for name in sorted(tensors):
            print(f"{name}  {list(tensors[name].shape)}  {tensors[name].dtype}")
    print(f"wrote {len(tensors)} tensors ({sum(t.nbytes for t in tensors.values()):,} bytes) to {out}")


def _export_hf(cfg, tensors: dict[str, np.ndarray], out: Path, dtype: str, listing: bool, pad: bool) -> int:
    from detjax.export_hf import ExportError, convert, write_tokenizer
    from detjax.sample import SampleError, run_tokenizer

    try:
        ck = convert(cfg.to_dict()["model"], tensors, cfg.train.seq_len, pad)
        tok = run_tokenizer(cfg)
    except (ExportError, SampleError) as e:
        print(f"error: cannot export as a transformers checkpoint: {e}", file=sys.stderr)
        return 2
    if out.exists() and not out.is_dir():
        print(f"error: {out} is a file; --format hf writes a directory. Fix: pass a directory path", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if dtype == "bfloat16":
        import ml_dtypes

        ck.tensors = {k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v for k, v in ck.tensors.items()}
        ck.config["torch_dtype"] = "bfloat16"
    specials = write_tokenizer(out, tok)
    ck.config.update({k: v for k, v in specials.items() if v is not None})
    ck.config["detjax_config_hash"] = cfg.hash()
    (out / "config.json").write_text(json.dumps(ck.config, indent=2, sort_keys=True) + "\n")
    gen = {k: v for k, v in specials.items() if v is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_safetensors(out / "model.safetensors", ck.tensors, {"format": "pt", "detjax_config_hash": cfg.hash()})
    family = ck.config["architectures"][0]
    for note in ck.notes:
        print(f"note: {note}")
    _report(ck.tensors, f"{out} ({family})", listing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
