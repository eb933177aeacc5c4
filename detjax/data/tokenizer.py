"""Byte-level tokenizer: ids 0..255 are bytes; three specials follow."""

from __future__ import annotations

import numpy as np

BOS, EOS, PAD = 256, 257, 258
N_IDS = 259


def encode(text: str, *, eos: bool = True) -> np.ndarray:
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    return np.concatenate([ids, np.array([EOS], np.uint16)]) if eos else ids


def decode(ids) -> str:
    arr = np.asarray(ids)
    return bytes(int(i) for i in arr if i < 256).decode("utf-8", errors="replace")
