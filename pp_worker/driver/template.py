"""A model's chat template (the GGUF's tokenizer.chat_template, a Jinja program) rendered the way the model's
authors render it: as Hugging Face transformers' apply_chat_template does, in jinja2's sandbox.

transformers (utils/chat_template_utils.py): an ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and
loop controls; `tojson` without ASCII or HTML escaping; globals `raise_exception` and `strftime_now`; rendered
with `messages`, `add_generation_prompt` and the special tokens' texts (`bos_token`, `eos_token`). Templates come
from model files, so the sandbox matters: attribute probing (`__class__`...) raises instead of reaching Python.

Templates usually write `bos_token` themselves, and the first stage puts a BOS in front of the prompt too when
the model wants one: like llama.cpp's server, `prompt` drops a rendered leading BOS then, so there is exactly one.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

Message = dict[str, Any]


def _environment() -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %}...{% endgeneration %}: transformers marks assistant text with it; render the body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled template; jinja2.TemplateError (syntax) at construction, any exception the template raises from
    ``render``."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None,
                 add_bos: bool = False):
        self.source, self.template = source, _environment().from_string(source)
        self.bos_token, self.eos_token, self.add_bos = bos_token or "", eos_token or "", add_bos

    def render(self, messages: list[Message], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """``tools``: OpenAI's tool objects ({"type": "function", "function": {...}}), as transformers passes them."""
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    documents=None, bos_token=self.bos_token, eos_token=self.eos_token)

    def prompt(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> str:
        """The text to tokenize for the assistant's next turn (without the BOS tokenizing adds)."""
        text = self.render(messages, tools=tools)
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text
