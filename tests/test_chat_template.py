"""The driver renders a model's chat template with jinja2 as transformers does, and falls back to the built-in
formats when the template cannot render. Templates are written here after the real models' ones."""

from __future__ import annotations

import pytest

from pp_worker.driver.chat import CHAT_FORMATS, PLAIN_CHAT, TemplateFormat, chat_format
from pp_worker.driver.template import ChatTemplate

# Llama 3.x Instruct's template, without its tool-calling branches
LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'Cutting Knowledge Date: December 2023\\n\\n' }}\n"
    "{{- system_message }}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
# Qwen2's: ChatML with a default system message
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Gemma's: no system role, strict alternation
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
TURNS = [("user", "Hello"), ("assistant", " Hi there "), ("user", "Who are you?")]
MESSAGES = [{"role": r, "content": t} for r, t in TURNS]
BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"


def test_llama3_template_renders_like_the_model_and_leaves_the_bos_to_the_tokenizer():
    header = "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\n<|eot_id|>"
    turns = ("<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
             "<|start_header_id|>user<|end_header_id|>\n\nWho are you?<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ChatTemplate(LLAMA3, BOS, EOS).render(MESSAGES) == BOS + header + turns
    # the first stage adds the BOS (add_bos): the rendered one goes, so the prompt holds exactly one
    assert ChatTemplate(LLAMA3, BOS, EOS, add_bos=True).prompt(MESSAGES) == header + turns
    assert ChatTemplate(LLAMA3, BOS, EOS, add_bos=False).prompt(MESSAGES) == BOS + header + turns
    reply = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert ChatTemplate(LLAMA3, BOS, EOS).render(MESSAGES, False) == BOS + header + turns.removesuffix(reply)


def test_chatml_template_renders_like_the_built_in_format_plus_its_system_message():
    fmt = chat_format(CHATML, None, "<|im_end|>")
    assert isinstance(fmt, TemplateFormat) and fmt.stop == ("<|im_end|>",)  # the chatml markers' stop text
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    assert fmt.render(TURNS) == system + CHAT_FORMATS["<|im_start|>"].render(TURNS)


@pytest.mark.parametrize("template", [LLAMA3, CHATML, GEMMA])
def test_each_turn_extends_the_last_so_a_chat_reuses_its_kv_session(template):
    fmt = chat_format(template, BOS, EOS, add_bos=True)
    assert isinstance(fmt, TemplateFormat)
    assert fmt.render(TURNS).startswith(fmt.render(TURNS[:1]))


def test_a_turn_the_template_refuses_falls_back_with_a_message():
    logged: list[str] = []
    fmt = chat_format(GEMMA, "<bos>", "<eos>", log=logged.append)
    assert isinstance(fmt, TemplateFormat) and not logged
    assert fmt.render(TURNS).startswith("<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n")
    broken = [("user", "a"), ("user", "b")]  # no alternation: the template raises
    assert fmt.render(broken) == PLAIN_CHAT.render(broken)
    assert "TemplateError: Conversation roles must alternate" in logged[0]


@pytest.mark.parametrize("template, error", [
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
    ("{{ messages.__class__.__mro__ }}<|im_start|>", "SecurityError"),  # templates come from model files: sandboxed
    ("{{ messages[0]['nope'] + 1 }}", "UndefinedError"),
])
def test_a_template_that_cannot_render_is_replaced_by_a_built_in_format(template, error):
    logged: list[str] = []
    fmt = chat_format(template, log=logged.append)
    assert fmt is (CHAT_FORMATS["<|im_start|>"] if "<|im_start|>" in template else PLAIN_CHAT)
    assert error in logged[0]


def test_transformers_extras_work():
    template = ("{%- for m in messages %}{%- if m['role'] == 'stop' %}{% break %}{% endif %}"
                "{%- if m['role'] == 'assistant' %}{% generation %}A: {{ m['content'] }}\n{% endgeneration %}"
                "{%- else %}U: {{ m['content'] | tojson }}\n{% endif %}{%- endfor %}"
                "{{ strftime_now('%Y') | length }}")
    messages = [{"role": "user", "content": "é<"}, {"role": "assistant", "content": "ok"}, {"role": "stop"},
                {"role": "user", "content": "never"}]
    assert ChatTemplate(template).render(messages) == 'U: "é<"\nA: ok\n4'  # no ASCII / HTML escaping in tojson
