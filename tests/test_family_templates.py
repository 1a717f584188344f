"""The chat templates of the families render through the jinja2 path, with the features they
use that Llama's do not: `namespace` state, `raise_exception`, reversed loops with `loop`
fields, string methods, `loop controls`. The templates are shortened from the checkpoints'
own (same constructs), typed here; the expected prompts are written by hand.
"""

import pytest

from nanoserve.errors import InvalidRequestError
from nanoserve.tokenizer import Tokenizer

# Qwen2.5's shape: a default system turn, tools in a system block, ChatML turns.
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.'"
    " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's shape: a namespace found by a reversed loop, reasoning split out of assistant turns.
QWEN3 = (
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and reasoning is defined %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Gemma's: a system turn folded into the first user turn, alternation enforced by raise_exception,
# 'assistant' renamed 'model', contents trimmed.
GEMMA = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
# Loop controls (`break`, `continue`), as some Phi and Mistral templates use.
LOOP_CONTROLS = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}{%- continue -%}{%- endif -%}"
    "{{ '<|' + message.role + '|>' + message.content + '<|end|>' }}"
    "{%- if loop.index >= 3 -%}{%- break -%}{%- endif -%}"
    "{%- endfor -%}{{ '<|assistant|>' if add_generation_prompt else '' }}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
        {"role": "assistant", "content": "<think>\nsay hello\n</think>\n\nHello."},
        {"role": "user", "content": "Bye"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer.from_dir(tiny_model_dir)


def test_qwen25_template_adds_its_default_system_turn(tokenizer):
    out = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], chat_template=QWEN25)
    assert out == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                   "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_template_drops_reasoning_before_the_last_user_turn(tokenizer):
    out = tokenizer.apply_chat_template(CHAT, chat_template=QWEN3, template_kwargs={"enable_thinking": False})
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n"
                   "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_template_keeps_reasoning_after_the_last_user_turn(tokenizer):
    out = tokenizer.apply_chat_template(CHAT[:3], chat_template=QWEN3, add_generation_prompt=False)
    assert out.endswith("<|im_start|>assistant\n<think>\nsay hello\n</think>\n\nHello.<|im_end|>\n")


def test_gemma_template_folds_the_system_turn_and_renames_the_assistant(tokenizer):
    out = tokenizer.apply_chat_template(CHAT, chat_template=GEMMA)
    assert out.endswith("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
                        "<think>\nsay hello\n</think>\n\nHello.<end_of_turn>\n<start_of_turn>user\nBye"
                        "<end_of_turn>\n<start_of_turn>model\n")


def test_gemma_template_raise_exception_is_a_request_error_with_its_message(tokenizer):
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        tokenizer.apply_chat_template(two_users, chat_template=GEMMA)


def test_loop_controls_continue_and_break(tokenizer):
    out = tokenizer.apply_chat_template(CHAT, chat_template=LOOP_CONTROLS)
    # the system turn is skipped; the loop breaks after its third message (the assistant's)
    assert out == "<|user|> Hi <|end|><|assistant|><think>\nsay hello\n</think>\n\nHello.<|end|><|assistant|>"
