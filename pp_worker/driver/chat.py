"""Interactive chat over a running pipeline: one KV session per conversation, kept on the stages from turn to
turn, so each turn prefills only what is new.

Turns become a prompt through the model's own chat template (stage 0's ready line carries it; rendered with
jinja2, `template`), or, when there is none or it does not render, through a built-in format recognised by a
marker in it (llama3, chatml), else a plain "User: ... Assistant:" one.
"""

from __future__ import annotations

import os
import select
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pp_worker.driver.generation import Generation, Sampling, TextSink
from pp_worker.driver.pipeline import Cancel, Pipeline
from pp_worker.driver.template import ChatTemplate

Turns = list[tuple[str, str]]  # (role, text)


class Format(Protocol):
    name: str
    stop: tuple[str, ...]  # text that ends the answer when the model does not emit an EOS id

    def render(self, turns: Turns) -> str:
        """The prompt that asks for the assistant's next turn."""


@dataclass(frozen=True)
class ChatFormat:
    """A built-in format: ``turn`` formats (role, text); ``reply`` opens the assistant's turn."""

    name: str
    turn: str
    reply: str
    stop: tuple[str, ...] = ()

    def render(self, turns: Turns) -> str:
        return "".join(self.turn.format(role=role, Role=role.capitalize(), text=t) for role, t in turns) + self.reply


# Recognised by a marker in the model's tokenizer.chat_template.
CHAT_FORMATS = {
    "<|start_header_id|>": ChatFormat("llama3", "<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>",
                                      "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "<|im_start|>": ChatFormat("chatml", "<|im_start|>{role}\n{text}<|im_end|>\n", "<|im_start|>assistant\n",
                               ("<|im_end|>",)),
}
PLAIN_CHAT = ChatFormat("plain", "{Role}: {text}\n", "Assistant:", ("\nUser:",))


# a conversation every chat template must take: rendering it at start-up tells whether the template works here
PROBE: Turns = [("user", "Hello"), ("assistant", "Hi."), ("user", "How are you?")]


@dataclass(frozen=True)
class TemplateFormat:
    """The model's own chat template; a turn it fails to render (raise_exception...) falls back to ``fallback``."""

    template: ChatTemplate
    fallback: ChatFormat
    log: Callable[[str], None]
    name: str = "the model's chat template"

    @property
    def stop(self) -> tuple[str, ...]:
        return self.fallback.stop if self.fallback is not PLAIN_CHAT else ()

    def render(self, turns: Turns) -> str:
        try:
            return self.template.prompt(_messages(turns))
        except Exception as e:  # a template raises what it likes (raise_exception, a failed lookup, a type error)
            self.log(f"the chat template failed ({type(e).__name__}: {e}); this turn uses the {self.fallback.name} "
                     f"format")
            return self.fallback.render(turns)


def chat_format(template: str | None, bos_token: str | None = None, eos_token: str | None = None,
                add_bos: bool = False, log: Callable[[str], None] = lambda msg: None) -> Format:
    """The model's template when it renders a plain conversation, else the built-in format its markers name, else
    the plain "User: ...\\nAssistant:" one. ``bos_token``, ``eos_token``, ``add_bos``: stage 0's ready line."""
    markers = next((f for marker, f in CHAT_FORMATS.items() if template and marker in template), PLAIN_CHAT)
    if not template:
        return markers
    try:
        fmt = TemplateFormat(ChatTemplate(template, bos_token, eos_token, add_bos), markers, log)
        fmt.template.prompt(_messages(PROBE))
    except Exception as e:
        log(f"the model's chat template does not render ({type(e).__name__}: {e}); using the {markers.name} format")
        return markers
    return fmt


def _messages(turns: Turns) -> list[dict[str, str]]:
    return [{"role": role, "content": text} for role, text in turns]


class Conversation:
    """One chat's turns and its KV session. The session stays on the stages between turns; each turn renders the
    whole conversation (one BOS, at its start, when the model wants one) and prefills only what the session does
    not hold yet."""

    def __init__(self, p: Pipeline, fmt: Format, max_tokens: int, sampling: Sampling):
        self.p, self.fmt, self.max_tokens, self.sampling = p, fmt, max_tokens, sampling
        self.request_id = p.new_request_id()
        self.turns: list[tuple[str, str]] = []
        self.held: list[int] = []  # the tokens the session's KV cache holds

    def ask(self, text: str, on_text: TextSink | None = None) -> Generation:
        """One turn; a turn that cannot run (the conversation no longer fits in max_context) leaves no trace."""
        turns = [*self.turns, ("user", text)]
        g = Generation(0, self.fmt.render(turns), self.request_id, self.max_tokens, self.sampling,
                       cached=self.held, on_text=on_text, keep_session=True)
        self.p.run([g])
        if g.stop_reason != "error":
            self.turns = [*turns, ("assistant", _cut(g.text, self.fmt.stop).strip())]
            self.held = g.prompt_tokens + g.tokens[:-1]  # the last token was sampled, never fed
        return g

    def close(self) -> None:
        """Release the conversation's KV session on every stage."""
        self.p.release(self.request_id)


def pipeline_chat_format(p: Pipeline, log: Callable[[str], None] = lambda msg: None) -> Format:
    """``chat_format`` for the model the pipeline runs, from stage 0's ready line."""
    ready = p.stages[0].ready or {}
    return chat_format(p.chat_template, ready.get("bos_token"), ready.get("eos_token"), bool(ready.get("add_bos")),
                       log)


def chat(p: Pipeline, max_tokens: int, sampling: Sampling, cancel: Cancel | None) -> None:
    """Read user lines from stdin and answer each in one conversation, until end of input."""
    fmt = pipeline_chat_format(p, log=lambda msg: print(f"pp-pipeline: {msg}", file=sys.stderr, flush=True))
    conversation = Conversation(p, fmt, max_tokens, sampling)
    label = fmt.name if isinstance(fmt, TemplateFormat) else f"{fmt.name} format"
    print(f"chat ({label}); end with Ctrl-D", file=sys.stderr, flush=True)
    lines = _Lines(cancel)
    while (line := lines.next()) is not None:
        g = conversation.ask(line, _ChatStream(fmt.stop))
        if g.error:
            print(f"pp-pipeline: {g.error}: the conversation is full; end it (Ctrl-D) to start another",
                  file=sys.stderr, flush=True)
    conversation.close()


class _ChatStream:
    """Streams an answer, stopping at the format's stop text (and asking the generation to stop)."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop, self.shown = stop, 0

    def __call__(self, g: Generation, text: str, finished: bool) -> None:
        cut = _cut(text, self.stop)
        g.stop_requested = g.stop_requested or cut != text
        # hold back a possible start of a stop text (and a trailing U+FFFD, as Output does)
        safe = cut if finished or cut != text else cut.rstrip("\ufffd")[: max(0, len(cut) - _longest(self.stop))]
        if len(safe) > self.shown:
            sys.stdout.write(safe[self.shown:])
            self.shown = len(safe)
        if finished:
            sys.stdout.write("\n")
        sys.stdout.flush()


def _cut(text: str, stop: tuple[str, ...]) -> str:
    ends = [i for s in stop if (i := text.find(s)) >= 0]
    return text[: min(ends)] if ends else text


def _longest(stop: tuple[str, ...]) -> int:
    return max((len(s) for s in stop), default=0)


class _Lines:
    """Lines from stdin that a signal can interrupt: it waits in select on stdin and the wake-up pipe (a blocked
    input() would not see the signal) and reads with os.read into its own buffer (a buffered readline could hold
    a second pasted line where select cannot see it)."""

    def __init__(self, cancel: Cancel | None):
        self.cancel, self.fd, self.buf = cancel, sys.stdin.fileno(), b""

    def next(self) -> str | None:
        print(">>> ", end="", file=sys.stderr, flush=True)
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.fd] + ([self.cancel.wake_fd] if self.cancel else []), [], [], 1.0)
            if self.cancel:
                self.cancel.check(ready)
            if self.fd in ready:
                chunk = os.read(self.fd, 1 << 16)
                if not chunk:  # end of input: a last line without its newline still counts
                    line, self.buf = self.buf, b""
                    return line.decode(errors="replace") if line else None
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode(errors="replace")
