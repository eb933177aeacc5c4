"""Append-only trace streams: one JSON line per record, one file per device shard, under <run>/trace/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax

from detjax import fingerprint as fp
from detjax.trace.capture import meta_of


def stream_path(run_dir: Path, device_id: int) -> Path:
    return Path(run_dir) / "trace" / f"stream-d{device_id}.jsonl"


def append(run_dir: Path, device_id: int, records: list[dict[str, Any]]) -> None:
    """Append records to their device's stream (`device` field, else `device_id`)."""
    by_dev: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_dev.setdefault(int(r.get("device", device_id)), []).append(r)
    for dev, recs in sorted(by_dev.items()):
        p = stream_path(run_dir, dev)
        p.parent.mkdir(parents=True, exist_ok=True)
        with p.open("a") as f:
            for r in recs:
                f.write(json.dumps(r, sort_keys=True) + "\n")


def _split(meta: dict[str, Any], row: Any) -> tuple[list[str], list[str]]:
    digs = [fp.digest_hex(r) for r in row]
    if meta.get("rowwise"):
        return [], ["".join(digs)]
    return digs[: meta["n_in"]], digs[meta["n_in"] :]


def capture_records(taps: dict[str, Any], step: int, level: str) -> list[dict[str, Any]]:
    """Phase/module capture (detjax.trace.capture): taps["micro"] values are stacked along the microbatch
    axis; each key is the record's identity (its static description)."""
    vm, vs = jax.device_get(taps["micro"]), jax.device_get(taps["step"])
    out = []
    n_micro = len(next(iter(vm.values()))) if vm else 0
    for mb in range(n_micro):
        for key, v in vm.items():
            m = meta_of(key)
            ins, outs = _split(m, v[mb])
            out.append(dict(m, level=level, step=step, micro=mb, inputs=ins, outputs=outs))
    for key, v in vs.items():
        m = meta_of(key)
        ins, outs = _split(m, v)
        out.append(dict(m, level=level, step=step, inputs=ins, outputs=outs))
    return out


def op_records(meta: list[dict[str, Any]], values: list[Any], step: int) -> list[dict[str, Any]]:
    """Op capture: records inside a scan are stacked along iterations; emit them iteration-major."""
    vals = jax.device_get(values)
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(meta):
        sid = meta[i].get("scan")
        j = i
        while j < len(meta) and meta[j].get("scan") == sid and meta[j].get("shard_map") == meta[i].get("shard_map"):
            j += 1
        if meta[i].get("shard_map"):  # one record per device shard, for that device's stream
            for k in range(i, j):
                for s, dev in enumerate(meta[k]["shard_devices"]):
                    ins, outs = _split(meta[k], vals[k][s])
                    out.append(dict(meta[k], level="op", step=step, shard=s, device=dev, inputs=ins, outputs=outs))
        elif sid is None:
            for k in range(i, j):
                ins, outs = _split(meta[k], vals[k])
                out.append(dict(meta[k], level="op", step=step, inputs=ins, outputs=outs))
        else:
            for it in range(len(vals[i])):
                for k in range(i, j):
                    ins, outs = _split(meta[k], vals[k][it])
                    out.append(dict(meta[k], level="op", step=step, iteration=it, inputs=ins, outputs=outs))
        i = j
    return out
