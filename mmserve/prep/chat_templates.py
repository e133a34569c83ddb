"""Built-in chat templates (Jinja, rendered by transformers' `apply_chat_template`) for checkpoints that carry none,
each named by its family's spec (families/table.py, by config.json's `architectures[0]`). A checkpoint's own
template comes first and `--chat_template FILE` overrides both. Image parts arrive as `{"type": "image"}`
(openai_protocol.chat_messages); each template writes its family's placeholder for them, the one the family's prompt
processor expands.

- LLaVA-1.5 (`LlavaForConditionalGeneration`, `LlavaLlamaForCausalLM`): LLaVA's `conv_vicuna_v1`
  (`llava_v1` in LLaVA's code): `<system> USER: <image>\\n... ASSISTANT: <answer></s>USER: ... ASSISTANT:`, with
  LLaVA-1.5's system prompt unless the messages bring one. A message's images come first, one `<image>\\n` each (as
  LLaVA was trained and as llava-hf's published template puts them), then its text parts joined by spaces.
- Qwen-VL-Chat (`QWenLMHeadModel`): ChatML as Qwen's `make_context` builds it (default system "You are a helpful
  assistant."); each image is `Picture N: <img></img>\\n` as Qwen's `from_list_format` writes it, N counting the
  conversation's images as Qwen-VL's web demo does. The empty `<img></img>` takes the request's next image.
- Qwen2-VL / Qwen2.5-VL: ChatML as Qwen2-VL-*-Instruct publish it, one
  `<|vision_start|><|image_pad|><|vision_end|>` per image (`add_vision_id=True` in chat_template_kwargs numbers them).
- Qwen3-VL: the template Qwen3-VL-*-Instruct publish (chat_template.json): the same ChatML and vision blocks, but no
  default system turn, and Qwen3's tool-call format.
- InternVL (`InternVLForConditionalGeneration`): the template the `-hf` repositories publish (transformers'
  conversion script): ChatML without a default system turn, one `<IMG_CONTEXT>\\n` per image part, which
  InternVLProcessor (and the family's prompt processor) expands to `<img><IMG_CONTEXT>...</img>`.
- InternVL's remote-code layout (`InternVLChatModel`): its `internvl2_5` conversation (ChatML with InternVL's
  default system message), `<image>\\n` per image part, which the prompt processor expands as its `chat` does.
- Gemma 3 (`Gemma3ForConditionalGeneration`): the template google/gemma-3-*-it publish: `<start_of_turn>user` /
  `<start_of_turn>model` turns, a system message folded into the first user turn, one `<start_of_image>` per image
  part, which Gemma3Processor (and the family's prompt processor) expands to its 256 soft tokens.
"""

from __future__ import annotations

import json
import os

from families import architectures, family

LLAVA_SYSTEM_PROMPT = (
    "A chat between a curious human and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the human's questions."
)

LLAVA_1_5 = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] if messages[0]['content'] is string "
    "else messages[0]['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '" + LLAVA_SYSTEM_PROMPT.replace("'", "\\'") + "' %}"
    "{% set loop_messages = messages %}{% endif %}"
    "{{ system }} "
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('a system message may only come first') }}{% endif %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set images = message['content'] | selectattr('type', 'equalto', 'image') | list | length %}"
    "{% set text = '<image>\n' * images + message['content'] | selectattr('type', 'equalto', 'text') "
    "| map(attribute='text') | join(' ') %}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}USER: {{ text }} {% else %}ASSISTANT: {{ text }}</s>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

QWEN_VL_CHAT = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{% set image_count.value = image_count.value + 1 %}"
    "Picture {{ image_count.value }}: <img></img>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# As published with Qwen/Qwen2-VL-7B-Instruct (tokenizer_config.json and chat_template.json): a default system turn,
# one vision block per image part.
QWEN2_VL = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# As OpenGVLab/InternVL3-*-hf publish it (chat_template.json): transformers' InternVL conversion script's template.
INTERNVL = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}{% elif content['type'] == 'video' %}"
    "{{ '<video>\\n' }}{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)

INTERNVL_SYSTEM_PROMPT = (
    "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。"
)
# The remote-code layout (OpenGVLab/InternVL3-8B, InternVL2_5-*): its `internvl2_5` conversation template (the remote
# code's conversation.py: MPT separators on ChatML roles, InternVL's default system message) with `<image>\n` per
# image part, as its `chat` prepends it to a question.
INTERNVL_CHAT = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n" + INTERNVL_SYSTEM_PROMPT + "<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}<image>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# google/gemma-3-4b-it's (and 12b-it's, 27b-it's) chat template, as its tokenizer_config.json carries it.
GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '

' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"""

# Qwen/Qwen3-VL-8B-Instruct's chat_template.json, byte for byte (5292 bytes, SHA-256 3636d0f0bd6bef02...a489e4).
QWEN3_VL = (
    r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"""
    r"""You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within """
    r"""<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": """
    r"""<args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' }}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
)  # fmt: skip


def model_architecture(model_dir: str | None) -> str | None:
    """config.json's architectures[0], or None."""
    if not model_dir:
        return None
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            architectures = json.load(f).get("architectures") or [None]
    except (OSError, ValueError):
        return None
    return architectures[0]


def builtin_chat_template(architecture: str | None) -> str | None:
    """The family's built-in template (None for a family without one, e.g. text-only Llama, or not served here)."""
    if architecture not in architectures():
        return None
    spec = family(architecture)
    return spec.part("chat_template") if spec.chat_template else None
