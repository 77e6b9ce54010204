"""What a chat template sees and writes as transformers' ``apply_chat_template`` has it: the ``generation`` block,
a continued last message, content parts, ``range`` and ``tojson``."""

from __future__ import annotations

from typing import Any

import pytest

from kestrel_core.errors import KestrelError
from kestrel_core.model.chat_template import (
    compile_chat_template,
    continue_final_message,
    loops_over_content,
    render_chat,
    template_content,
)

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
ASK = [{"role": "user", "content": "Say"}]


def _render(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    return render_chat(compile_chat_template(source), messages, add_generation_prompt)


def test_a_generation_block_renders_its_body() -> None:
    """transformers marks the assistant's tokens with it (LFM2.5's templates): no mask asked, its body as is."""
    source = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
              "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    assert _render(source, [*ASK, {"role": "assistant", "content": "yo"}]) == "<user>Say<assistant>yo"


@pytest.mark.parametrize(("prefill", "end"), [
    ("The answer is ", "<|im_start|>assistant\nThe answer is "),  # its trailing whitespace kept
    (">", "<|im_start|>assistant\n>"),  # not found again in the end of turn after it (">" of "<|im_end|>")
    ("end", "<|im_start|>assistant\nend"),
    ("", "<|im_start|>assistant\n"),  # empty: right after the turn's header
])
def test_a_continued_message_ends_where_its_text_does(prefill: str, end: str) -> None:
    template = compile_chat_template(CHATML)
    prompt = continue_final_message(lambda ms: render_chat(template, ms, False),
                                    [*ASK, {"role": "assistant", "content": prefill}])
    assert prompt == "<|im_start|>user\nSay<|im_end|>\n" + end


def test_a_message_the_template_does_not_write_cannot_be_continued() -> None:
    template = compile_chat_template("{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}")
    with pytest.raises(KestrelError, match="cannot be continued"):
        continue_final_message(lambda ms: render_chat(template, ms, False), [*ASK, {"role": "assistant",
                                                                                  "content": "x"}])


@pytest.mark.parametrize(("expression", "text"), [
    ("range(3)[1]", "1"), ("range(3)|last", "2"), ("range(3) is sequence", "True"),
    ("range(3) == range(3)", "True"), ("range(2)|list", "[0, 1]"),
    ("{'a': 1}|tojson(indent='  ')", '{\n  "a": 1\n}'), ("{'a': 1}|tojson(indent=1)", '{\n "a": 1\n}'),
])
def test_range_and_tojson_behave_as_in_transformers(expression: str, text: str) -> None:
    assert _render("{{ " + expression + " }}", ASK) == text


# GLM-4.6's way (a macro over the parts, strings too), MiniMax-M2's (the loop on the message's own field) and a
# filtered loop; then templates that read content as a string
LOOPING = [
    ("{% macro text(content) %}{% if content is string %}{{ content }}{% else %}{% for p in content %}"
     "{{ p.text }}{% endfor %}{% endif %}{% endmacro %}{% for m in messages %}[{{ text(m.content) }}]{% endfor %}"),
    ("{% for m in messages %}[{% if m['content'] is string %}{{ m['content'] }}{% else %}"
     "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}]{% endfor %}"),
    ("{% for m in messages %}[{% for p in m.content | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
     "{% endfor %}]{% endfor %}"),
]
READING = [CHATML, "{% for m in messages %}{% for line in m.content.split('x') %}{{ line }}{% endfor %}{% endfor %}"]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]


@pytest.mark.parametrize("source", LOOPING)
def test_a_template_that_loops_over_content_gets_its_parts(source: str) -> None:
    """As transformers passes a list: the template joins the parts its own way (here with nothing between)."""
    assert loops_over_content(source)
    content = template_content(PARTS[0]["content"], loops_over_content(source))
    assert _render(source, [{"role": "user", "content": content}]) == "[ab]"


@pytest.mark.parametrize("source", READING)
def test_a_template_that_reads_a_string_gets_the_parts_joined_by_newlines(source: str) -> None:
    assert not loops_over_content(source)
    assert template_content(PARTS[0]["content"], False) == "a\nb"
    assert template_content("as is", False) == template_content("as is", True) == "as is"


def test_a_continued_message_of_parts_ends_after_its_last_text() -> None:
    template = compile_chat_template(LOOPING[1])
    prefill = {"role": "assistant", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y "}]}
    prompt = continue_final_message(lambda ms: render_chat(template, ms, False), [*PARTS, prefill])
    assert prompt == "[ab][xy "


# Command R's template (c4ai-command-r's tokenizer_config.json, its default), with its tool_use template's way of
# writing each tool as a Python signature (a macro, .items(), loop.index0, |length) in a system turn
COMMAND_R = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% elif false == true %}{% set loop_messages = messages %}"
    "{% set system_message = 'You are Command-R.' %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% macro signature(tool) %}def {{ tool.name }}({% for name, fields in tool.parameter_definitions.items() %}"
    "{% if loop.index0 > 0 %}, {% endif %}{{ name }}: {% if not fields.required %}"
    "{{ 'Optional[' + fields.type + '] = None' }}{% else %}{{ fields.type }}{% endif %}{% endfor %}) -> List[Dict]:"
    "{% endmacro %}"
    "{% if tools %}{{ '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>## Available Tools' }}"
    "{% for tool in tools %}{{ '\\n' + signature(tool) }}{% endfor %}{{ '<|END_OF_TURN_TOKEN|>' }}{% endif %}"
    "{% if system_message != false %}{{ '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + system_message + "
    "'<|END_OF_TURN_TOKEN|>' }}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set content = message['content'] %}{% if message['role'] == 'user' %}"
    "{{ '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + content.strip() + '<|END_OF_TURN_TOKEN|>' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'  + content.strip() + '<|END_OF_TURN_TOKEN|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}"
)
SEARCH = {"name": "internet_search", "description": "Search the web",
          "parameter_definitions": {"query": {"type": "str", "required": True},
                                    "max_results": {"type": "int", "required": False}}}


def test_a_command_r_template_renders_as_transformers_does() -> None:
    """Command R's template, to the text transformers renders (checked with transformers 5.25): the system turn
    taken off the messages by a slice, its alternation check by raise_exception, each turn's text stripped, the BOS
    it writes itself, a tool's signature from a macro."""
    template = compile_chat_template(COMMAND_R)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi \n"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Search"}]
    turn = "<|START_OF_TURN_TOKEN|>"
    assert render_chat(template, chat, True, bos_token="<BOS_TOKEN>") == (
        f"<BOS_TOKEN>{turn}<|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|>{turn}<|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|>"
        f"{turn}<|CHATBOT_TOKEN|>Hello.<|END_OF_TURN_TOKEN|>{turn}<|USER_TOKEN|>Search<|END_OF_TURN_TOKEN|>"
        f"{turn}<|CHATBOT_TOKEN|>")
    tools = render_chat(template, chat[1:2], False, bos_token="", tools=[SEARCH])
    assert tools.startswith(f"{turn}<|SYSTEM_TOKEN|>## Available Tools\n"
                            "def internet_search(query: str, max_results: Optional[int] = None) -> List[Dict]:"
                            "<|END_OF_TURN_TOKEN|>")
    with pytest.raises(KestrelError, match="Conversation roles must alternate") as info:
        render_chat(template, chat[2:], True, bos_token="")
    assert "\n" not in str(info.value)
