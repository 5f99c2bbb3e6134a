"""Choosing the next token from the last logits, on the host with NumPy.

The steps, in order: the ``logits_processor`` hook, the repetition penalty, then greedy choice
(``temperature <= 0``) or sampling: logits divided by the temperature, cut by top-k, top-p and
min-p (each keeps at least the most likely token), one draw from what is left.

>>> import numpy as np
>>> s = Sampler(temperature=0.0)
>>> s.next_token(np.array([0.1, 2.0, -1.0], np.float32), [])
1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

# (ids so far: prompt and generated, logits (vocab,) float32) -> logits
LogitsProcessor = Callable[[Sequence[int], np.ndarray], np.ndarray]


@dataclass
class Sampler:
    """The sampling settings of one generation, with its random stream.

    ``top_k`` keeps the k most likely tokens (0: all); ``top_p`` the smallest set of most
    likely tokens whose probabilities add up to at least p (1.0: all); ``min_p`` the tokens at
    least ``min_p`` times as likely as the most likely one (0: all). ``repetition_penalty``
    divides the positive logits of tokens already seen and multiplies the negative ones
    (1.0: off). ``seed`` makes the draws reproducible.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logits_processor: LogitsProcessor | None = None
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got "
                             f"{self.repetition_penalty}")
        self.rng = np.random.default_rng(self.seed)

    def process(self, logits: np.ndarray, ids: Sequence[int]) -> np.ndarray:
        """The hook and the repetition penalty applied (a new float32 array)."""
        logits = np.array(logits, dtype=np.float32, copy=True).reshape(-1)
        if self.logits_processor is not None:
            logits = np.asarray(self.logits_processor(ids, logits), dtype=np.float32)
        if self.repetition_penalty != 1.0 and len(ids):
            seen = np.unique(np.asarray(ids, dtype=np.int64))
            seen = seen[(seen >= 0) & (seen < logits.size)]
            values = logits[seen]
            logits[seen] = np.where(values > 0, values / self.repetition_penalty,
                                    values * self.repetition_penalty)
        return logits

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution sampled from: softmax of logits / temperature, restricted by
        top-k, top-p and min-p and renormalized (float64)."""
        scaled = logits.astype(np.float64) / self.temperature
        keep = scaled > -np.inf
        if self.top_k and self.top_k < scaled.size:
            kth = np.partition(scaled, -self.top_k)[-self.top_k]
            keep &= scaled >= kth
        scaled = np.where(keep, scaled, -np.inf)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if self.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            before = np.cumsum(probs[order]) - probs[order]  # mass of the likelier tokens
            cut = np.zeros_like(probs, dtype=bool)
            cut[order] = before >= self.top_p
            probs = np.where(cut, 0.0, probs)
        if self.min_p > 0.0:
            probs = np.where(probs >= self.min_p * probs.max(), probs, 0.0)
        return probs / probs.sum()

    def next_token(self, logits: np.ndarray, ids: Sequence[int]) -> int:
        """The next token after ``ids`` given the model's ``logits`` for it."""
        logits = self.process(logits, ids)
        if self.temperature <= 0.0:
            return int(np.argmax(logits))
        probs = self.probabilities(logits)
        return int(self.rng.choice(probs.size, p=probs))
