"""Section 17: conversations that don't start over (issue 52): prefix reuse across requests in pp-serve.

A chat client sends the whole conversation each turn. Through pp-serve (its own process, warm workers, 2 stages),
one conversation of ``turns`` turns whose first turn is a system message of about ``first_turn`` tokens (the
model's context permitting), each turn a short user message after the previous answer: each turn's time to first
token (from the request sent to the first streamed content), and then the last turn's request again, identical. Once
with prefix reuse (``cache_prompt``, pp-serve's default) and once without (``cache_prompt: false`` on every request:
every turn prefills everything). Then ``clients`` conversations at once, each client its own (a different opening
word, so nothing is shared between clients), with and without reuse: the median time to first token of each turn
across clients, and the wall time of the whole. Every conversation opens with a word of its own, so no run reuses an
earlier one's session. The target: the next turn and the identical repeat reach their first token in <= 0.25x the
first turn's time.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from bench import models
from bench.quant import say
from bench.serve import Endpoint
from pp_worker import DEFAULT_MODEL

ZEN = ("Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. Complex is "
       "better than complicated. Flat is better than nested. Sparse is better than dense. Readability counts. ")
ANSWER_ROOM = 24  # positions a turn adds beside its answer (the user's line and the format's markers)


@dataclass(frozen=True)
class ReusePlan:
    preset: str | None = None  # a bench.models preset (generated once); None: the embedded model
    dtype: str = "F16"
    stages: int = 2
    first_turn: int = 1000  # tokens of the first turn's prompt, lowered to what the context leaves room for
    turns: int = 5
    max_tokens: int = 8  # per answer
    clients: int = 8


class Chat:
    """One conversation through a pp-serve endpoint: each turn's request streamed, its time to first token."""

    def __init__(self, e: Endpoint, system: str, cache_prompt: bool, max_tokens: int):
        self.e, self.cache_prompt, self.max_tokens = e, cache_prompt, max_tokens
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]

    def turn(self, user: str) -> dict[str, Any]:
        """Ask, time the first token, keep the answer in the conversation: {ttft_s, cached_tokens, prompt_tokens}."""
        self.messages.append({"role": "user", "content": user})
        out = self.ask()
        self.messages.append({"role": "assistant", "content": out.pop("text")})
        return out

    def ask(self) -> dict[str, Any]:
        body = json.dumps({"model": "m", "messages": self.messages, "max_tokens": self.max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True},
                           "cache_prompt": self.cache_prompt}).encode()
        req = urllib.request.Request(f"{self.e.url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        t0, first, text, usage = time.monotonic(), None, "", {}
        with urllib.request.urlopen(req, timeout=1200) as r:
            for line in r:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                delta = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content") or ""
                if delta and first is None:
                    first = time.monotonic() - t0
                text += delta
        return {"ttft_s": first if first is not None else time.monotonic() - t0, "text": text,
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "prompt_tokens": usage["prompt_tokens"]}


def measure(plan: ReusePlan) -> dict[str, Any]:
    model = models.ensure_model(plan.preset, dtype=plan.dtype) if plan.preset else DEFAULT_MODEL
    context = models.facts(model).context
    e = Endpoint(plan.stages, plan.clients, model=str(model))
    try:
        system = _system(e, min(plan.first_turn, context - plan.turns * (plan.max_tokens + ANSWER_ROOM)))
        out: dict[str, Any] = {"model": model.name, "context": context, "stages": plan.stages, "turns": plan.turns,
                               "max_tokens": plan.max_tokens, "clients": plan.clients}
        Chat(e, "Warm " + system, True, plan.max_tokens).turn("Hello")  # whatever compiles on first use
        for mode, cache in (("on", True), ("off", False)):
            say(f"reuse: one {plan.turns}-turn chat, reuse {mode}")
            out[mode] = _conversation(e, f"{mode.title()} {system}", cache, plan)
        for mode, cache in (("on", True), ("off", False)):
            say(f"reuse: {plan.clients} chats at once, reuse {mode}")
            out[f"clients_{mode}"] = _together(e, system, cache, plan)
    finally:
        e.close()
    say(f"reuse: {json.dumps(out)}")
    return out


def _system(e: Endpoint, tokens: int) -> str:
    """Zen lines repeated to about ``tokens`` tokens (counted by the server's tokenizer)."""
    unit = _count(e, ZEN)
    return ZEN * max(1, tokens // max(1, unit))


def _count(e: Endpoint, text: str) -> int:
    req = urllib.request.Request(f"{e.url}/tokenize", json.dumps({"content": text}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return len(json.loads(r.read())["tokens"])


def _conversation(e: Endpoint, system: str, cache: bool, plan: ReusePlan) -> dict[str, Any]:
    chat = Chat(e, system, cache, plan.max_tokens)
    turns = [chat.turn(f"Explicit {i}") for i in range(plan.turns)]
    chat.messages.pop()  # the last answer: the last request again, identical
    repeat = chat.ask()
    repeat.pop("text")
    return {"turns": turns, "repeat": repeat}


def _together(e: Endpoint, system: str, cache: bool, plan: ReusePlan) -> dict[str, Any]:
    ttfts: list[list[float]] = [[] for _ in range(plan.turns)]
    lock = threading.Lock()

    def client(i: int) -> None:
        chat = Chat(e, f"Client{i}{'on' if cache else 'off'} {system}", cache, plan.max_tokens)
        for t in range(plan.turns):
            ttft = chat.turn(f"Explicit {t}")["ttft_s"]
            with lock:
                ttfts[t].append(ttft)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(plan.clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall_s": time.monotonic() - t0, "median_ttft_s": [statistics.median(t) for t in ttfts],
            "max_ttft_s": [max(t) for t in ttfts]}
