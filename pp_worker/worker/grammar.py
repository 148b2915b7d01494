"""Constrained decoding on the last stage: a grammar (a JSON schema, Lark, GBNF or a regex) masks the logits of each
step to the tokens that keep the output inside it, with llguidance (the library llama.cpp uses).

A generation's first ``forward_and_sample`` carries ``grammar``; the stage keeps one matcher per session, masks every
step's logits with it before the sampler runs (bias, penalties and the draw then see only allowed tokens) and advances
it with the sampled token. A matcher belongs to one generation: the stage sees hidden states, never the tokens a
request feeds, so any step that is not the generation's next one (a rewind, a new prompt on a kept session) ends it,
and a step carrying ``grammar`` (an object, or null for none) starts the next. Once the grammar is complete only an
end-of-sequence id is allowed.

llguidance is imported only when a grammar arrives: a stage that never sees one never loads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pp_worker.worker.text.vocabulary import Vocabulary

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

KINDS = ("json_schema", "json_object", "lark", "gbnf", "regex")
# JSON as people write it on one line ('{"a": 1, "b": [2, 3]}'): no run of whitespace a small model can loop in
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


class GrammarError(ValueError):
    """A grammar that cannot be used: its message names what is wrong (becomes an error reply)."""


@dataclass(frozen=True)
class Grammar:
    """A validated ``grammar`` field: its kind and the llguidance grammar it compiles to."""

    kind: str
    compiled: str  # llguidance's grammar text (JSON), the input of LLMatcher

    @staticmethod
    def parse(value: Any) -> Grammar:
        """``{"type": "json_schema", "schema": {...}, "strict": true}``, ``{"type": "json_object"}`` or
        ``{"type": "lark" | "gbnf" | "regex", "text": "..."}`` -> a Grammar, checked by compiling it (no vocabulary
        needed); GrammarError naming the field otherwise. ``strict`` false: schema keywords llguidance does not
        implement are ignored instead of refused."""
        if not isinstance(value, dict) or value.get("type") not in KINDS:
            got = value.get("type") if isinstance(value, dict) else type(value).__name__
            raise GrammarError(f"'grammar.type' must be one of {', '.join(KINDS)}, got {str(got)[:40]!r}")
        kind = value["type"]
        if kind in ("json_schema", "json_object"):
            schema = value.get("schema", {}) if kind == "json_schema" else {"type": "object"}
            strict = value.get("strict", True)
            if not isinstance(schema, dict | bool):
                raise GrammarError("'grammar.schema' must be a JSON schema (an object)")
            if not isinstance(strict, bool):
                raise GrammarError("'grammar.strict' must be true or false")
            options = {**JSON_STYLE, "lenient": not strict}  # not strict: keywords llguidance lacks are ignored
            return Grammar(kind, _compile(kind, lambda lg: lg.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=options)))
        text = value.get("text")
        if not isinstance(text, str) or not text:
            raise GrammarError(f"'grammar.text' must be the {kind} grammar as a non-empty string")
        return Grammar(kind, _compile(kind, lambda lg: lg.grammar_from(kind, text)))


def _compile(kind: str, make: Callable[[Any], str]) -> str:
    import llguidance

    try:
        compiled = make(llguidance)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled)
    except (ValueError, TypeError, RuntimeError) as e:  # a bad schema raises from the converters
        raise GrammarError(f"'grammar' ({kind}) does not compile: {e}") from None
    if failed:
        raise GrammarError(f"'grammar' ({kind}) does not compile: {'; '.join(messages)[:500]}")
    return compiled


def _tokenizer(v: Vocabulary, n_logits: int) -> LLTokenizer:
    """llguidance's tokenizer over ``n_logits`` ids (a head wider than the vocabulary: the rest never allowed)."""
    from llguidance import LLTokenizer, TokenizerWrapper

    if not v.eos:
        raise GrammarError("the model names no end-of-sequence token; a grammar cannot end its output")
    return LLTokenizer(TokenizerWrapper(_Encoder(v)), n_vocab=max(n_logits, len(v.tokens)), eos_token=v.eos)


class _Encoder:
    """The shape TokenizerWrapper reads (llguidance calls it with bytes or str)."""

    def __init__(self, v: Vocabulary):
        self.tokens, self.special_token_ids, self._encode = v.tokens, v.special, v.encode
        self.eos_token_id, self.bos_token_id = v.eos[0], None

    def __call__(self, text: bytes | str) -> list[int]:
        return self._encode(text.decode(errors="replace") if isinstance(text, bytes) else text)


@dataclass
class _Held:
    matcher: LLMatcher
    next_position: int  # the position the generation's next step feeds (its last sampled token's)


class Constraints:
    """The last stage's matchers, one per session (a generation's), and the mask each puts on the logits.

    ``vocabulary`` gives the model's Vocabulary (None: the stage has none, e.g. the stub, and grammars are accepted
    and not applied); it is read, and llguidance's tokenizer built (~0.5 s at 150K tokens), at the first grammar."""

    def __init__(self, vocabulary: Callable[[], Vocabulary | None], n_logits: int):
        self._vocabulary, self._n_logits = vocabulary, n_logits
        self._tokenizer: LLTokenizer | None = None
        self._held: dict[int, _Held] = {}

    def mask(self, session: int, fields: dict[str, Any], logits: Any) -> Any:
        """``logits`` (vocab,) with every token the session's grammar forbids at -inf; unchanged without one. A
        step carrying ``grammar`` starts a new matcher; one that is not its generation's next step ends it."""
        held = self._held.get(session)
        if "grammar" in fields:
            held = self._begin(session, fields["grammar"])
        elif held is not None and (fields["position"] != held.next_position or fields["seq_len"] != 1):
            del self._held[session]  # a rewind or a new prompt: the tokens it feeds are not the ones sampled
            held = None
        if held is None:
            return logits
        return _masked(np.asarray(logits), self._allowed(held.matcher))

    def advance(self, session: int, fields: dict[str, Any], token: int) -> None:
        """The sampled ``token`` enters the session's matcher; its next step feeds it at position + seq_len."""
        held = self._held.get(session)
        if held is None:
            return
        if not held.matcher.consume_token(token):
            self._held.pop(session)
            raise GrammarError(f"token {token} does not fit the grammar: {held.matcher.get_error()}")
        held.next_position = fields["position"] + fields["seq_len"]

    def release(self, session: int) -> None:
        self._held.pop(session, None)

    def keep_only(self, sessions: Iterable[int]) -> None:
        """Forget the matchers of sessions the engine no longer holds (evicted, reset)."""
        alive = set(sessions)
        for rid in [rid for rid in self._held if rid not in alive]:
            del self._held[rid]

    def sessions(self) -> list[int]:
        return sorted(self._held)

    def _begin(self, session: int, grammar: Grammar | None) -> _Held | None:
        self._held.pop(session, None)
        tokenizer = self._llg_tokenizer() if grammar is not None else None
        if tokenizer is None:
            return None
        from llguidance import LLMatcher

        matcher = LLMatcher(tokenizer, grammar.compiled)
        if matcher.is_error():
            raise GrammarError(f"'grammar' ({grammar.kind}) cannot be used with this vocabulary: "
                               f"{matcher.get_error()[:500]}")
        self._held[session] = held = _Held(matcher, -1)
        return held

    def _llg_tokenizer(self) -> LLTokenizer | None:
        if self._tokenizer is None:
            vocabulary = self._vocabulary()
            if vocabulary is None:
                return None
            self._tokenizer = _tokenizer(vocabulary, self._n_logits)
        return self._tokenizer

    def _allowed(self, matcher: LLMatcher) -> np.ndarray:
        """(vocab,) bool: the tokens the matcher allows next (llguidance writes a bitmask of 32-bit words)."""
        words = np.empty((self._tokenizer.vocab_size + 31) // 32, dtype=np.int32)  # type: ignore[union-attr]
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if matcher.is_error():
            raise GrammarError(f"the grammar's matcher failed: {matcher.get_error()[:500]}")
        return np.unpackbits(words.view(np.uint8), bitorder="little").view(bool)


def _masked(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """A new array (an engine's logits may be its reusable buffer): forbidden ids at -inf. (vocab,) float32."""
    return np.where(allowed[:logits.size], logits, np.float32(-np.inf))
