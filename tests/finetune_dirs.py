"""Tiny model folders of the shapes `examples/finetune_*.json` point at, each with its model's own
chat template on the tokenizer (`data.template: "model"` reads it), and a LLaVA-Instruct JSON
dataset for them. Built locally from configs and seeds: no hub."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.chat_templates import QWEN2_VL
from tests.data_layouts import write_llava_json
from tests.fixtures import TINY_VISION

CHATML = ["<|im_start|>", "<|im_end|>"]

# llava-hf/llava-onevision-qwen2-*-ov-hf (as transformers' processor tests carry it)
LLAVA_ONEVISION = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}{# Render all video then #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\n' + content['text'] }}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ '\n' + content['text'] }}{% endgeneration %}{% endfor %}{% endif %}"
    "{{'<|im_end|>'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")

# HuggingFaceTB/SmolVLM-Instruct (model_type idefics3)
SMOLVLM = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")

# Qwen/Qwen2.5-*-Instruct, without its tool-calling branches
QWEN2_5 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}"
    "{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or "
    "message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def _with_template(tok, tokens: list[str], template: str):
    tok.add_tokens([t for t in tokens if t not in tok.get_vocab()], special_tokens=True)
    tok.chat_template = template
    return tok


def make_qwen2_vl(out: Path) -> Path:
    """A Qwen2-VL-Instruct-shaped folder (`family_dirs.make_qwen2_vl_dir`) with ChatML tokens and
    Qwen2-VL-Instruct's template."""
    from tests.family_dirs import make_qwen2_vl_dir, qwen_tokenizer
    return make_qwen2_vl_dir(out, _with_template(qwen_tokenizer(), CHATML, QWEN2_VL))


def _generic(out: Path, model_type: str, tokens: list[str], template: str) -> Path:
    """The coverage sweep's tiny recipe of `model_type`, its tokenizer given `tokens` and the
    model's chat template (the vocabulary grown to match), saved as `make_generic_dir` does."""
    from ds_omni.coverage.sweep import RECIPES, save_processor_parts
    from ds_omni.model.families import family_for
    config, processor = RECIPES[model_type]()
    tok = _with_template(processor.tokenizer, tokens, template)
    config.text_config.vocab_size = len(tok)
    torch.manual_seed(0)
    family_for(model_type).build_hf(config).save_pretrained(str(out), safe_serialization=True)
    save_processor_parts(processor, out)
    return out


def make_llava_onevision(out: Path) -> Path:
    return _generic(out, "llava_onevision", CHATML, LLAVA_ONEVISION)


def make_idefics3(out: Path) -> Path:
    return _generic(out, "idefics3", ["<|im_start|>"], SMOLVLM)


def make_composed_parts(out: Path) -> tuple[Path, Path]:
    """(LLM folder, CLIP folder): a Qwen2.5-Instruct-shaped causal LM with its tokenizer and
    template (the Qwen vision tokens included, as Qwen2.5's tokenizer has them), and a CLIP
    vision tower."""
    from transformers import CLIPVisionConfig, CLIPVisionModel, Qwen2Config, Qwen2ForCausalLM
    from tests.family_dirs import qwen_tokenizer
    tok = _with_template(qwen_tokenizer(), CHATML, QWEN2_5)
    torch.manual_seed(0)
    llm = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    llm.save_pretrained(str(out / "llm"), safe_serialization=True)
    tok.save_pretrained(str(out / "llm"))
    vision = {k: v for k, v in TINY_VISION.items() if k != "model_type"}
    CLIPVisionModel(CLIPVisionConfig(**vision)).save_pretrained(str(out / "clip"),
                                                                safe_serialization=True)
    return out / "llm", out / "clip"


def write_llava_data(out: Path) -> tuple[Path, Path]:
    """(train file, eval file): LLaVA-Instruct JSON arrays with relative image paths (and
    text-only rows) in folders of their own."""
    train, _ = write_llava_json(out / "train", n=12)
    val, _ = write_llava_json(out / "val", n=4)
    return train, val
