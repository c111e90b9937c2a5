"""Real chat templates of released Instruct models, and small tokenizers to go with them.

The template strings are those the models ship (tokenizer_config.json / chat_template.json);
the tokenizers are trained here with `tokenizers` on a few sentences, with each model's special
tokens and the same kind of pre-tokenisation (byte-level BPE for Qwen and Llama 3, SentencePiece-
style metaspace BPE for Gemma and Mistral), so no hub is needed.
"""

from __future__ import annotations

# Qwen/Qwen2-VL-7B-Instruct
QWEN2_VL = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# meta-llama/Meta-Llama-3-8B-Instruct
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")

# google/gemma-3-4b-it
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
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
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
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
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# mistralai/Mistral-7B-Instruct-v0.3, without its tool-calling branches. It writes the system
# prompt into the *last* user message: not prefix-stable once there is a system prompt.
MISTRAL = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
        {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
    {%- set ns.index = ns.index + 1 %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# llava-hf/llava-1.5-7b-hf: reads contents only as lists of parts (a string renders as nothing)
LLAVA15 = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")

# Qwen2-VL's template with the assistant text and its end-of-turn token in a generation block
# (as templates written for assistant masks have them)
QWEN2_VL_GENERATION = QWEN2_VL.replace(
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n",
    "{% if message['content'] is string %}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}")

FAMILIES = {
    # name: (template, special tokens, bos, eos, pre-tokenisation, how an assistant turn renders)
    "qwen2_vl": (QWEN2_VL, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                            "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
                 None, "<|im_end|>", "bytelevel", "{}<|im_end|>"),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", "bytelevel", "{}<|eot_id|>"),
    "gemma3": (GEMMA3, ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                        "<start_of_image>", "<end_of_image>", "<image_soft_token>"],
               "<bos>", "<eos>", "metaspace_never", "{}<end_of_turn>"),
    "mistral": (MISTRAL, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]"],
                "<s>", "</s>", "metaspace_first", " {}</s>"),
}

CORPUS = ["You are a helpful assistant.", "What colour is the square?", "It is red.",
          "And the circle next to it?", "The circle is blue, and larger.", "Answer briefly.",
          "Describe the picture.", "A small green triangle on a white background."]


def make_tokenizer(family: str, template: str | None = None):
    """A `PreTrainedTokenizerFast` in the style of `family`'s, carrying its chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    source, specials, bos, eos, pre, _ = FAMILIES[family]
    unk = "<unk>" if "<unk>" in specials else None
    tok = Tokenizer(models.BPE(unk_token=unk))
    if pre == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        scheme = pre.split("_")[1]
        tok.pre_tokenizer = pre_tokenizers.Sequence([  # newlines are pieces of their own
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)])
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=scheme)
        alphabet = sorted(set("".join(CORPUS)) | {"\u2581", "\n"})
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=alphabet)
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   unk_token=unk, chat_template=template or source)
