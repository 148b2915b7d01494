"""Turn the last position's logits (vocab,) into a token id: argmax, or seeded sampling.

Filter order, the same on every path; each step means what it does in llama.cpp and HF transformers:
  1. repetition penalty on the distinct ``recent_tokens`` (positive logit / penalty, negative * penalty)
  2. temperature == 0 -> argmax of the penalised logits, no random draw; else logits / temperature
  3. top_k: keep the k highest logits (ties: the lower id wins)
  4. softmax in float64, shifted by the max so it cannot overflow
  5. top_p: keep the smallest prefix of the sorted distribution whose mass >= top_p (never empty)
  6. min_p: drop tokens with p < min_p * p_max
  7. renormalise and draw with PCG64 seeded from (seed, step_key); seed None -> fresh OS entropy
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

MAX_RECENT_TOKENS = 4096


def _as_logits(logits: Sequence[float] | np.ndarray) -> np.ndarray:
    x = np.array(logits, dtype=np.float64)  # (vocab,); a copy, because the penalty writes into it
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array, got shape {x.shape}")
    return x


def argmax_sample(logits: Sequence[float] | np.ndarray) -> int:
    """Index of the largest logit; ties -> lowest index; NaN counts as -inf. ValueError if empty or all NaN."""
    x = _as_logits(logits)
    if np.isnan(x).all():
        raise ValueError("all logits are NaN")
    return int(np.argmax(np.where(np.isnan(x), -np.inf, x)))  # np.argmax alone would return the first NaN


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; build them with ``parse_sampling`` so the bounds are checked."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    recent_tokens: tuple[int, ...] = ()
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SamplingError(ValueError):
    """A sampling field of a request is invalid; the message names the field and its bound."""


# name -> (type, bound in errors, test). Float bounds are finite and NaN fails every comparison: no NaN/inf gets by.
_NUMBERS: dict[str, tuple[type, str, Callable[[float], bool]]] = {
    "temperature": (float, "a number in [0, 100]", lambda v: 0 <= v <= 100),
    "top_k": (int, "an integer >= 0", lambda v: v >= 0),
    "top_p": (float, "a number in (0, 1]", lambda v: 0 < v <= 1),
    "min_p": (float, "a number in [0, 1)", lambda v: 0 <= v < 1),
    "repetition_penalty": (float, "a number in (0, 100]", lambda v: 0 < v <= 100),
    "seed": (int, "an integer in [0, 2**63)", lambda v: 0 <= v < 2**63),
}


def _number(name: str, value: object) -> float | int:
    kind, bound, ok = _NUMBERS[name]
    accepted = (int, float) if kind is float else int
    if isinstance(value, bool) or not isinstance(value, accepted) or not ok(value):  # JSON true is not 1
        raise SamplingError(f"'{name}' must be {bound}, got {reprlib.repr(value)}")
    return kind(value)


def _recent_tokens(value: object, vocab_size: int) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or len(value) > MAX_RECENT_TOKENS:
        got = f"{len(value)} items" if isinstance(value, list | tuple) else reprlib.repr(value)
        raise SamplingError(f"'recent_tokens' must be a list of at most {MAX_RECENT_TOKENS} token ids, got {got}")
    bad = next((i for i, t in enumerate(value) if type(t) is not int or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise SamplingError(f"'recent_tokens[{bad}]' must be a token id in [0, {vocab_size}), got {value[bad]!r:.40}")
    return tuple(value)


def parse_sampling(req: dict, vocab_size: int) -> SamplingParams | None:
    """Validated sampling fields of a request, or None when it carries none (the caller stays on plain argmax)."""
    if not any(name in req for name in (*_NUMBERS, "recent_tokens")):
        return None
    fields: dict = {name: _number(name, req[name]) for name in _NUMBERS if name in req}
    if "recent_tokens" in req:
        fields["recent_tokens"] = _recent_tokens(req["recent_tokens"], vocab_size)
    return SamplingParams(**fields)


def _penalise(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    if params.repetition_penalty == 1.0 or not params.recent_tokens:
        return x
    ids = np.unique(np.asarray(params.recent_tokens, dtype=np.int64))  # a repeated token is penalised once
    if ids[0] < 0 or ids[-1] >= x.size:
        raise ValueError(f"recent_tokens must lie in [0, {x.size})")
    v = x[ids]
    x[ids] = np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    return x


def _candidates(x: np.ndarray, top_k: int, ordered: bool) -> np.ndarray:
    """Ids with a usable logit (not -inf/NaN); when ``ordered``, best first with ties lower id first, cut to top_k."""
    ids = np.flatnonzero(x > -np.inf)  # NaN compares False, so it drops out here too
    if 0 < top_k < ids.size:  # pre-select in O(vocab) so only ~k ids get sorted
        kth = np.partition(x[ids], ids.size - top_k)[ids.size - top_k]
        ids = ids[x[ids] >= kth]
    if ordered:  # a full-vocab stable sort costs ~10 ms at 128k, so only top_k/top_p pay for it
        ids = ids[np.argsort(-x[ids], kind="stable")]
    return ids[:top_k] if top_k else ids


def distribution(logits: Sequence[float] | np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids the filters keep and their renormalised probabilities; most probable first if top_k/top_p is set."""
    x = _penalise(_as_logits(logits), params)
    if params.greedy:
        return np.array([argmax_sample(x)]), np.ones(1)
    ids = _candidates(x, params.top_k, ordered=params.top_k > 0 or params.top_p < 1.0)
    if ids.size == 0:
        raise ValueError("no logit is finite; cannot sample")
    z = np.minimum(x[ids], np.finfo(np.float64).max)  # an overflowed +inf logit would turn the softmax into NaN
    with np.errstate(over="ignore"):  # a tiny temperature sends the non-max logits to -inf: p = 0, as intended
        p = np.exp((z - z.max()) / params.temperature)  # shifting first keeps the max at exactly exp(0) = 1
    p /= p.sum()
    if params.top_p < 1.0:
        n = int(np.searchsorted(np.cumsum(p), params.top_p)) + 1  # first prefix whose mass reaches top_p
        ids, p = ids[:n], p[:n]
    keep = (p >= params.min_p * p.max()) & (p > 0)  # p > 0 also drops probabilities that underflowed
    return ids[keep], p[keep] / p[keep].sum()


def sample(logits: np.ndarray, params: SamplingParams | None, step_key: int = 0) -> int:
    """Next token id. ``step_key`` (e.g. the position) varies the draw between steps of one seeded request."""
    if params is None:
        return argmax_sample(logits)
    ids, p = distribution(logits, params)
    if ids.size == 1:  # greedy, or the filters left one token: no random draw needed
        return int(ids[0])
    seed = None if params.seed is None else np.random.SeedSequence((params.seed, step_key & (2**64 - 1)))
    u = np.random.Generator(np.random.PCG64(seed)).random()  # in [0, 1)
    return int(ids[min(int(np.searchsorted(np.cumsum(p), u, side="right")), ids.size - 1)])
