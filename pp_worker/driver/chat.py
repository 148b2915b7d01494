"""Interactive chat over a running pipeline: one KV session per conversation, growing turn by turn."""

from __future__ import annotations

import os
import select
import sys
from dataclasses import dataclass

from pp_worker import DEFAULT_MODEL
from pp_worker.driver.generation import Generation, Sampling
from pp_worker.driver.pipeline import Cancel, Pipeline


@dataclass(frozen=True)
class ChatFormat:
    """How turns become a prompt: ``turn`` formats (role, text); ``reply`` opens the assistant's turn."""

    name: str
    turn: str
    reply: str
    stop: tuple[str, ...] = ()  # text that ends the answer when the model does not emit an EOS id


# Recognised by a marker in the GGUF's tokenizer.chat_template (a Jinja program; we do not run Jinja).
CHAT_FORMATS = {
    "<|start_header_id|>": ChatFormat("llama3", "<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>",
                                      "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "<|im_start|>": ChatFormat("chatml", "<|im_start|>{role}\n{text}<|im_end|>\n", "<|im_start|>assistant\n",
                               ("<|im_end|>",)),
}
PLAIN_CHAT = ChatFormat("plain", "{Role}: {text}\n", "Assistant:", ("\nUser:",))


def chat_format(model: str | None) -> ChatFormat:
    """The format for a local GGUF's chat template, or the plain "User: ...\\nAssistant:" one."""
    template = _chat_template(model)
    return next((f for marker, f in CHAT_FORMATS.items() if template and marker in template), PLAIN_CHAT)


def _chat_template(model: str | None) -> str | None:
    path = model or str(DEFAULT_MODEL)
    if not os.path.isfile(path):  # a model name, or a path on another machine: we cannot look inside
        return None
    try:
        from gguf import GGUFReader

        f = GGUFReader(path).fields.get("tokenizer.chat_template")
        return None if f is None else str(f.contents())
    except Exception:  # an unreadable file: the stage workers will report it properly
        return None


def render_chat(fmt: ChatFormat, turns: list[tuple[str, str]]) -> str:
    text = "".join(fmt.turn.format(role=role, Role=role.capitalize(), text=t) for role, t in turns)
    return text + fmt.reply


def chat(p: Pipeline, fmt: ChatFormat, max_tokens: int, sampling: Sampling, cancel: Cancel | None) -> None:
    """Read a user line, answer it in one KV session that grows turn by turn (only new tokens are prefilled)."""
    turns: list[tuple[str, str]] = []
    rid, held = p.new_request_id(), []
    print(f"chat ({fmt.name} format); end with Ctrl-D", file=sys.stderr, flush=True)
    lines = _Lines(cancel)
    while (line := lines.next()) is not None:
        turns.append(("user", line))
        g = Generation(0, render_chat(fmt, turns), rid, max_tokens, sampling, cached=held,
                       on_text=_ChatStream(fmt.stop))
        p.run([g])
        answer = _cut(g.text, fmt.stop)
        turns.append(("assistant", answer.strip()))
        held = g.prompt_tokens + g.tokens[:-1]  # what the session's KV cache holds now


class _ChatStream:
    """Streams an answer, stopping at the format's stop text (and asking the generation to stop)."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop, self.shown = stop, 0

    def __call__(self, g: Generation, text: str, finished: bool) -> None:
        cut = _cut(text, self.stop)
        g.stop_requested = g.stop_requested or cut != text
        # hold back a possible start of a stop text, and half a UTF-8 character
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
