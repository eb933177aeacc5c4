"""Tokenizers: the byte tokenizer (the default; ids 0..255 are bytes, three specials follow) and subword BPE
through HF `tokenizers` (a `tokenizer.json`, trained by `python -m detjax.data.prepare --train-bpe N` or
brought along).

Both give `encode(text, eos=True)`, `decode(ids)`, `vocab_size`, `eos_id`, `pad_id` and `sha256`, the hash of
what defines the mapping (the JSON for BPE), which `prepare` records in the shards' meta.json and training puts
into determinism.json and the config hash (`data.tokenizer_sha256`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

BOS, EOS, PAD = 256, 257, 258
N_IDS = 259
SPECIALS = ("<|eos|>", "<|bos|>", "<|pad|>")  # BPE: ids 0, 1, 2


class TokenizerError(ValueError):
    pass


def encode(text: str, *, eos: bool = True) -> np.ndarray:
    """Byte tokenizer: UTF-8 bytes (+ EOS) as uint16."""
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    return np.concatenate([ids, np.array([EOS], np.uint16)]) if eos else ids


def decode(ids) -> str:
    arr = np.asarray(ids)
    return bytes(int(i) for i in arr if i < 256).decode("utf-8", errors="replace")


def id_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned integer type that holds every id below vocab_size."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise TokenizerError(f"a vocabulary of {vocab_size} ids does not fit 32 bits")


class ByteTokenizer:
    kind = "bytes"
    vocab_size = N_IDS
    eos_id, bos_id, pad_id = EOS, BOS, PAD
    sha256 = hashlib.sha256(b"detjax byte tokenizer v1: ids 0-255 bytes, 256 BOS, 257 EOS, 258 PAD").hexdigest()

    def encode(self, text: str, eos: bool = True) -> np.ndarray:
        return encode(text, eos=eos)

    def decode(self, ids) -> str:
        return decode(ids)

    def to_json(self) -> str | None:
        return None


class BPETokenizer:
    """A HF `tokenizers` tokenizer.json. Its EOS / PAD ids are those of the special tokens `<|eos|>` and `<|pad|>`
    (the ones --train-bpe adds), or `</s>` / `<|endoftext|>` and `<pad>` in a brought tokenizer.json."""

    kind = "bpe"

    def __init__(self, json_text: str, source: str = "tokenizer.json") -> None:
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_str(json_text)
        except Exception as e:  # the library raises a bare Exception on malformed JSON
            first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            raise TokenizerError(f"{source} is not a tokenizers JSON file ({first})") from None
        self._json = json_text
        self.sha256 = hashlib.sha256(json_text.encode()).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._special(("<|eos|>", "</s>", "<|endoftext|>", "<eos>"), source, required=True)
        self.pad_id = self._special(("<|pad|>", "<pad>"), source, required=False)
        self.bos_id = self._special(("<|bos|>", "<s>", "<bos>"), source, required=False)

    def _special(self, names: tuple[str, ...], source: str, required: bool) -> int | None:
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return int(i)
        if required:
            raise TokenizerError(f"{source} has none of the end-of-document tokens {names}; add one to its vocabulary")
        return None

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        p = Path(path)
        if not p.is_file():
            raise TokenizerError(f"tokenizer {p} does not exist")
        return cls(p.read_text(encoding="utf-8"), str(p))

    def encode(self, text: str, eos: bool = True) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids + [self.eos_id] if eos else ids, dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids + [self.eos_id], dtype=np.uint32) for e in encs]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)

    def to_json(self) -> str:
        return self._json


def load(spec: str) -> ByteTokenizer | BPETokenizer:
    """'bytes' or the path of a tokenizer.json."""
    return ByteTokenizer() if spec in ("", "bytes") else BPETokenizer.load(spec)


def from_meta(meta: dict, directory: Path) -> ByteTokenizer | BPETokenizer:
    """The tokenizer a prepared corpus (its meta.json) was written with, checked against the recorded hash."""
    t = meta["tokenizer"]
    tok = ByteTokenizer() if t["kind"] == "bytes" else BPETokenizer.load(directory / "tokenizer.json")
    if tok.sha256 != t["sha256"]:
        raise TokenizerError(
            f"{directory}: the tokenizer's hash {tok.sha256[:12]} is not the one meta.json records "
            f"({t['sha256'][:12]}); the shards were written with another tokenizer"
        )
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> BPETokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenization, every byte in the initial alphabet, so any text
    encodes) with the specials <|eos|>, <|bos|>, <|pad|> as ids 0, 1, 2, trained on `texts` (streamed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIALS):
        raise TokenizerError(f"--train-bpe {vocab_size}: a byte-level BPE needs at least {256 + len(SPECIALS)} ids")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(json.dumps(json.loads(tok.to_str()), sort_keys=True))
