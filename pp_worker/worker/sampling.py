"""Turn the last position's logits (vocab,) into a token id: argmax, or seeded sampling.

Filter order, the same on every path; each step means what it does in llama.cpp and HF transformers:
  0. logit_bias: each listed token's bias added to its logit (OpenAI's field; llama.cpp applies it first too)
  1. penalties on ``recent_tokens``, as llama.cpp's penalties sampler: the repetition penalty on each distinct id
     (positive logit / penalty, negative * penalty), then OpenAI's frequency and presence penalties: an id seen c
     times there loses c * frequency_penalty + presence_penalty from its logit
  2. temperature == 0 -> argmax of the biased, penalised logits, no random draw; else logits / temperature
  3. top_k: keep the k highest logits (ties: the lower id wins)
  4. softmax in float64, shifted by the max so it cannot overflow
  5. top_p: keep the smallest prefix of the sorted distribution whose mass >= top_p (never empty)
  6. min_p: drop tokens with p < min_p * p_max
  7. renormalise and draw with PCG64 seeded from (seed, step_key); seed None -> fresh OS entropy

``token_logprobs`` reports log-probabilities of the model's own distribution: the softmax of the raw logits, before
the bias, the penalties, the temperature and the filters (as OpenAI and llama-server report them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def _as_logits(logits: Sequence[float] | np.ndarray) -> np.ndarray:
    x = np.array(logits, dtype=np.float64)  # (vocab,); a copy, because the penalty writes into it
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array, got shape {x.shape}")
    return x


def argmax_sample(logits: Sequence[float] | np.ndarray) -> int:
    """Index of the largest logit; ties -> lowest index; NaN counts as -inf. ValueError if empty or all NaN.

    One pass over the logits as they come (float32 from an engine): np.argmax returns the first NaN if there is
    one, so a non-NaN answer is the answer. Only logits holding a NaN pay for the copy that masks it (a 128K
    vocabulary: ~8 us against ~1 ms for the copy, the mask and the argmax)."""
    x = logits if isinstance(logits, np.ndarray) else np.asarray(logits)
    if x.ndim == 1 and x.size and x.dtype.kind == "f" and not math.isnan(x[i := int(x.argmax())]):
        return i  # ndarray.argmax and math.isnan: the same answer with less of numpy's code run per token
    x = _as_logits(logits)
    if np.isnan(x).all():
        raise ValueError("all logits are NaN")
    return int(np.argmax(np.where(np.isnan(x), -np.inf, x)))  # np.argmax alone would return the first NaN


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; ``worker.protocol.parse_sampling`` builds them with the bounds checked."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    recent_tokens: tuple[int, ...] = ()
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), distinct ids
    presence_penalty: float = 0.0  # OpenAI's, over ``recent_tokens``: once for any id seen there
    frequency_penalty: float = 0.0  # OpenAI's, over ``recent_tokens``: once per time an id is seen there

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logit bias or a penalty changes the logits before any choice."""
        return bool(self.logit_bias) or (self.penalised and bool(self.recent_tokens))

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _bias(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    if not params.logit_bias:
        return x
    ids = np.array([t for t, _ in params.logit_bias], dtype=np.int64)
    if ids.min() < 0 or ids.max() >= x.size:
        raise ValueError(f"logit_bias ids must lie in [0, {x.size})")
    x[ids] += np.array([b for _, b in params.logit_bias], dtype=np.float64)
    return x


def _penalise(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    if not params.penalised or not params.recent_tokens:
        return x
    ids, counts = np.unique(np.asarray(params.recent_tokens, dtype=np.int64), return_counts=True)
    if ids[0] < 0 or ids[-1] >= x.size:
        raise ValueError(f"recent_tokens must lie in [0, {x.size})")
    v = x[ids]  # a repeated token gets the repetition penalty once
    v = np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    x[ids] = v - counts * params.frequency_penalty - params.presence_penalty
    return x


def _candidates(x: np.ndarray, top_k: int) -> np.ndarray:
    """Ids with a usable logit (not -inf/NaN), in id order; with top_k, the best top_k first (ties: lower id first)."""
    ids = np.flatnonzero(x > -np.inf)  # NaN compares False, so it drops out here too
    if top_k == 0:
        return ids
    if top_k < ids.size:  # pre-select in O(vocab) so only ~k ids get sorted
        kth = np.partition(x[ids], ids.size - top_k)[ids.size - top_k]
        ids = ids[x[ids] >= kth]
    return ids[np.argsort(-x[ids], kind="stable")][:top_k]


def _top_p_prefix(xs: np.ndarray, p: np.ndarray, top_p: float) -> np.ndarray:
    """Positions of the shortest prefix, best logit ``xs`` first (ties in position order), whose mass ``p`` reaches
    ``top_p``. A whole vocabulary's sort costs ~14 ms at 128K ids, so the best m are sorted first, more only while
    their mass falls short: a prefix's running sums do not depend on what follows it, so the cut is the one a full
    sort would give."""
    m = 256
    while True:
        if m < xs.size:  # the best m, and whatever ties with the m-th
            at = np.flatnonzero(xs >= np.partition(xs, xs.size - m)[xs.size - m])
        else:
            at = np.arange(xs.size)
        order = at[np.argsort(-xs[at], kind="stable")]
        mass = np.cumsum(p[order])
        if mass[-1] >= top_p or at.size == xs.size:
            return order[:int(np.searchsorted(mass, top_p)) + 1]  # first prefix whose mass reaches top_p
        m *= 16


def distribution(logits: Sequence[float] | np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids the filters keep and their renormalised probabilities; most probable first if top_k/top_p is set
    (else in id order)."""
    x = _penalise(_bias(_as_logits(logits), params), params)
    if params.greedy:
        return np.array([argmax_sample(x)]), np.ones(1)
    ids = _candidates(x, params.top_k)
    if ids.size == 0:
        raise ValueError("no logit is finite; cannot sample")
    z = np.minimum(x[ids], np.finfo(np.float64).max)  # an overflowed +inf logit would turn the softmax into NaN
    with np.errstate(over="ignore"):  # a tiny temperature sends the non-max logits to -inf: p = 0, as intended
        p = np.exp((z - z.max()) / params.temperature)  # shifting first keeps the max at exactly exp(0) = 1
    p /= p.sum()
    if params.top_p < 1.0:
        at = _top_p_prefix(x[ids], p, params.top_p)
        ids, p = ids[at], p[at]
    keep = (p >= params.min_p * p.max()) & (p > 0)  # p > 0 also drops probabilities that underflowed
    return ids[keep], p[keep] / p[keep].sum()


def sample(logits: np.ndarray, params: SamplingParams | None, step_key: int = 0) -> int:
    """Next token id. ``step_key`` (e.g. the position) varies the draw between steps of one seeded request."""
    if params is None or (params.greedy and not params.adjusts_logits):
        return argmax_sample(logits)
    ids, p = distribution(logits, params)
    if ids.size == 1:  # greedy, or the filters left one token: no random draw needed
        return int(ids[0])
    seed = None if params.seed is None else np.random.SeedSequence((params.seed, step_key & (2**64 - 1)))
    u = np.random.Generator(np.random.PCG64(seed)).random()  # in [0, 1)
    return int(ids[min(int(np.searchsorted(np.cumsum(p), u, side="right")), ids.size - 1)])


LOGPROB_FLOOR = -9999.0  # a token the model gives no chance (a -inf or NaN logit): JSON has no -inf (OpenAI's value)


def token_logprobs(logits: Sequence[float] | np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of ``token``, the ``top`` most probable ids with theirs, most probable first, ties: the lower
    id first) under the softmax of the raw logits (within ~1e-7). NaN counts as -inf; at least ``LOGPROB_FLOOR``."""
    x = _as_logits(logits)
    x[np.isnan(x)] = -np.inf
    m = x.max()
    if not np.isfinite(m):
        raise ValueError("no logit is finite; no log-probabilities")
    # exp in float32 (numpy vectorises it, ~15x float64's at a 150K vocabulary), summed in float64: within ~1e-7
    lse = m + math.log(float(np.exp((x - m).astype(np.float32)).sum(dtype=np.float64)))

    def logprob(i: int) -> float:
        return max(float(x[i]) - lse, LOGPROB_FLOOR)

    return logprob(token), [(int(i), logprob(i)) for i in _highest(x, top)]


def _highest(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k highest values, highest first (ties: the lower id first). The k-th highest of the maxima of
    k or more blocks is a bound no lower than the k-th highest value (k blocks each hold a value that high), so
    only the ids at or above it get sorted: at a 150K vocabulary ~10x faster than a partition of all of it."""
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    ids, width = np.arange(x.size), max(1, x.size // 1024)
    if x.size // width > k:
        maxima = x[:x.size // width * width].reshape(-1, width).max(axis=1)
        ids = np.flatnonzero(x >= np.partition(maxima, maxima.size - k)[maxima.size - k])
    return ids[np.argsort(-x[ids], kind="stable")][:k]
