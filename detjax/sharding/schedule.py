"""Pipeline schedule simulator: GPipe / 1F1B / interleaved per-rank orders turned into a tick table.

A pure Python function of (kind, stages, virtual stages, microbatches); the executor in
detjax.sharding.pipeline runs the table. At each tick every rank runs one action -- forward F(v, m),
backward B(v, m) or nothing -- then sends its forward output to the next rank and its input gradient to the
previous rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IDLE, FWD, BWD = 0, 1, 2


@dataclass(frozen=True)
class Schedule:
    """Per tick and rank: action (IDLE/FWD/BWD), its virtual stage and microbatch, and what the rank
    receives at the end of the tick (forward activation / input gradient: valid flag, virtual stage, micro)."""

    action: np.ndarray  # (T, S, 3) int32: kind, v, m
    recv_f: np.ndarray  # (T, S, 3) int32: valid, v, m
    recv_b: np.ndarray  # (T, S, 3) int32: valid, v, m

    @property
    def ticks(self) -> int:
        return self.action.shape[0]

    def bubble(self) -> float:
        """Fraction of rank-ticks spent idle."""
        return float(np.mean(self.action[:, :, 0] == IDLE))


def _rank_order(kind: str, s: int, n_stages: int, n_virtual: int, n_micro: int) -> list[tuple[int, int, int]]:
    groups = n_micro // n_stages if n_virtual > 1 else 1
    if n_virtual > 1:  # Megatron's interleaved order: groups of S microbatches per virtual stage
        fwd = [(FWD, v, g * n_stages + i) for g in range(groups) for v in range(n_virtual) for i in range(n_stages)]
        bwd = [
            (BWD, v, g * n_stages + i)
            for g in range(groups)
            for v in reversed(range(n_virtual))
            for i in range(n_stages)
        ]
    else:
        fwd = [(FWD, 0, m) for m in range(n_micro)]
        bwd = [(BWD, 0, m) for m in range(n_micro)]
    if kind == "gpipe":
        return fwd + bwd
    total = len(fwd)
    if n_virtual > 1:
        warm = min((n_stages - s - 1) * 2 + (n_virtual - 1) * n_stages, total)
    else:
        warm = min(n_stages - s - 1, total)
    order = fwd[:warm]
    fi, bi = warm, 0
    while fi < total:
        order += [fwd[fi], bwd[bi]]
        fi, bi = fi + 1, bi + 1
    return order + bwd[bi:]


def build_schedule(kind: str, n_stages: int, n_virtual: int, n_micro: int) -> Schedule:
    """Simulate the per-rank orders tick by tick; an action runs once its input arrived at an earlier tick."""
    n_chunks = n_stages * n_virtual
    orders = [_rank_order(kind, s, n_stages, n_virtual, n_micro) for s in range(n_stages)]
    pos = [0] * n_stages
    done_f: dict[tuple[int, int], int] = {}  # (chunk, micro) -> tick
    done_b: dict[tuple[int, int], int] = {}
    ticks: list[list[tuple[int, int, int]]] = []
    while any(pos[s] < len(orders[s]) for s in range(n_stages)):
        t = len(ticks)
        row = []
        for s in range(n_stages):
            if pos[s] == len(orders[s]):
                row.append((IDLE, 0, 0))
                continue
            kind_, v, m = orders[s][pos[s]]
            c = v * n_stages + s
            if kind_ == FWD:
                ready = c == 0 or done_f.get((c - 1, m), t) < t
            else:
                ready = done_b.get((c + 1, m), t) < t if c < n_chunks - 1 else done_f.get((c, m), t) < t
            row.append((kind_, v, m) if ready else (IDLE, 0, 0))
        for s, (kind_, v, m) in enumerate(row):
            if kind_ != IDLE:
                (done_f if kind_ == FWD else done_b)[(v * n_stages + s, m)] = t
                pos[s] += 1
        ticks.append(row)
        if t > 4 * (n_chunks + 1) * (n_micro + 1) * 2:
            raise RuntimeError(f"pipeline schedule {kind} S={n_stages} V={n_virtual} M={n_micro} does not finish")
    action = np.array(ticks, np.int32)
    recv_f = np.zeros_like(action)
    recv_b = np.zeros_like(action)
    for t, row in enumerate(ticks):
        for s, (kind_, v, m) in enumerate(row):
            c = v * n_stages + s
            if kind_ == FWD and c < n_chunks - 1:
                recv_f[t, (s + 1) % n_stages] = (1, (c + 1) // n_stages, m)
            if kind_ == BWD and c > 0:
                recv_b[t, (s - 1) % n_stages] = (1, (c - 1) // n_stages, m)
    return Schedule(action, recv_f, recv_b)
