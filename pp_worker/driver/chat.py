"""Interactive chat over a running pipeline: one KV session per conversation, kept on the stages from turn to
turn, so each turn prefills only what is new."""

from __future__ import annotations

import os
import select
import sys
from dataclasses import dataclass

from pp_worker.driver.generation import Generation, Sampling, TextSink
from pp_worker.driver.pipeline import Cancel, Pipeline


@dataclass(frozen=True)
class ChatFormat:
    """How turns become a prompt: ``turn`` formats (role, text); ``reply`` opens the assistant's turn."""

    name: str
    turn: str
    reply: str
    stop: tuple[str, ...] = ()  # text that ends the answer when the model does not emit an EOS id


# Recognised by a marker in the model's tokenizer.chat_template (a Jinja program; we do not run Jinja).
CHAT_FORMATS = {
    "<|start_header_id|>": ChatFormat("llama3", "<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>",
                                      "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "<|im_start|>": ChatFormat("chatml", "<|im_start|>{role}\n{text}<|im_end|>\n", "<|im_start|>assistant\n",
                               ("<|im_end|>",)),
}
PLAIN_CHAT = ChatFormat("plain", "{Role}: {text}\n", "Assistant:", ("\nUser:",))


def chat_format(template: str | None) -> ChatFormat:
    """The format for a chat template (stage 0's ready line carries the model's), or the plain
    "User: ...\\nAssistant:" one."""
    return next((f for marker, f in CHAT_FORMATS.items() if template and marker in template), PLAIN_CHAT)


def render_chat(fmt: ChatFormat, turns: list[tuple[str, str]]) -> str:
    text = "".join(fmt.turn.format(role=role, Role=role.capitalize(), text=t) for role, t in turns)
    return text + fmt.reply


class Conversation:
    """One chat's turns and its KV session. The session stays on the stages between turns; each turn renders the
    whole conversation (one BOS, at its start, when the model wants one) and prefills only what the session does
    not hold yet."""

    def __init__(self, p: Pipeline, fmt: ChatFormat, max_tokens: int, sampling: Sampling):
        self.p, self.fmt, self.max_tokens, self.sampling = p, fmt, max_tokens, sampling
        self.request_id = p.new_request_id()
        self.turns: list[tuple[str, str]] = []
        self.held: list[int] = []  # the tokens the session's KV cache holds

    def ask(self, text: str, on_text: TextSink | None = None) -> Generation:
        """One turn; a turn that cannot run (the conversation no longer fits in max_context) leaves no trace."""
        turns = [*self.turns, ("user", text)]
        g = Generation(0, render_chat(self.fmt, turns), self.request_id, self.max_tokens, self.sampling,
                       cached=self.held, on_text=on_text, keep_session=True)
        self.p.run([g])
        if g.stop_reason != "error":
            self.turns = [*turns, ("assistant", _cut(g.text, self.fmt.stop).strip())]
            self.held = g.prompt_tokens + g.tokens[:-1]  # the last token was sampled, never fed
        return g

    def close(self) -> None:
        """Release the conversation's KV session on every stage."""
        self.p.release(self.request_id)


def chat(p: Pipeline, max_tokens: int, sampling: Sampling, cancel: Cancel | None) -> None:
    """Read user lines from stdin and answer each in one conversation, until end of input."""
    fmt = chat_format(p.chat_template)
    conversation = Conversation(p, fmt, max_tokens, sampling)
    print(f"chat ({fmt.name} format); end with Ctrl-D", file=sys.stderr, flush=True)
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
