"""The built-in corpus: generated English-like sentences and arithmetic, so nothing needs a download.

A fixed splitmix64 stream (not numpy's or Python's generators, whose streams may change between
versions) drives a small grammar, so the text is the same on every machine and version.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from detjax.data.tokenizer import encode

_ADJ = "red green blue small large quiet bright old young slow quick brave calm dark".split()
_NOUN = "fox dog bird cat river tree stone child farmer ship cloud king garden lamp".split()
_VERB = "sees follows finds paints carries watches helps greets builds hears".split()
_PLACE = "near the hill|by the sea|in the forest|under the bridge|at the market|on the road".split("|")
_NUM = "zero one two three four five six seven eight nine ten".split()


class SplitMix64:
    def __init__(self, seed: int) -> None:
        self.state = seed & 0xFFFFFFFFFFFFFFFF

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def pick(self, xs: list[str]) -> str:
        return xs[self.below(len(xs))]


def sentences(n: int, seed: int = 1234) -> Iterator[str]:
    r = SplitMix64(seed)
    for _ in range(n):
        kind = r.below(4)
        if kind == 0:
            subj, verb = f"{r.pick(_ADJ)} {r.pick(_NOUN)}", r.pick(_VERB)
            yield f"the {subj} {verb} the {r.pick(_ADJ)} {r.pick(_NOUN)} {r.pick(_PLACE)}."
        elif kind == 1:
            a, b = r.below(50), r.below(50)
            yield f"{a} plus {b} is {a + b}."
        elif kind == 2:
            k = r.below(6)
            yield "counting: " + " ".join(_NUM[k : k + 5]) + "."
        else:
            noun = r.pick(_NOUN)
            yield f"a {noun} is {r.pick(_ADJ)}, and the {noun} {r.pick(_VERB)} a {r.pick(_NOUN)}."


BUILTIN_EVAL_SEED = 98765  # the held-out stream's seed (the training text's is sentences()' default)


def builtin_tokens(n_sentences: int, seed: int = 1234) -> np.ndarray:
    """The built-in corpus as one uint16 token stream (each sentence ends with EOS)."""
    return np.concatenate([encode(s) for s in sentences(n_sentences, seed)])
