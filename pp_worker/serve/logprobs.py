"""The last stage's log-probabilities (``Generation.logprobs``: each token's ``{token_id, logprob, text, top}``) in
OpenAI's shapes: chat's ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal"}`` and the legacy
completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``. A token's ``bytes`` are its text's UTF-8 (a
token holding part of a character reads U+FFFD, whose bytes these are)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Entry = dict[str, Any]


def chat_logprobs(entries: Sequence[Entry]) -> dict[str, Any]:
    return {"content": [{**_token(e), "top_logprobs": [_token(t) for t in e["top"]]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: Sequence[Entry], offset: int) -> dict[str, Any]:
    """``offset``: where the first entry's text begins in the completion's text (a stream's earlier chunks)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["text"])
    return {"tokens": [e["text"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["text"]: t["logprob"] for t in e["top"]} for e in entries], "text_offset": offsets}


def _token(e: Entry) -> dict[str, Any]:
    return {"token": e["text"], "logprob": e["logprob"], "bytes": list(e["text"].encode())}
