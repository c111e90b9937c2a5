"""Conversations rendered with the model's own chat template: the ids are `apply_chat_template`'s,
the loss mask covers exactly the assistant turns; a template that is not prefix-stable, or that
cuts a token at a turn boundary, is an error naming the sample; exports carry the template."""

import pytest
import torch

from ds_omni.batch import EncodedItem, ItemProcessor
from ds_omni.data.processing import SampleProcessor
from ds_omni.data.problems import SampleError
from ds_omni.data.templates import PLAIN_HEADER, resolve_template
from ds_omni.errors import ConfigError
from ds_omni.model.family import Family
from tests.chat_templates import FAMILIES, QWEN2_VL_GENERATION, make_tokenizer

SYSTEM = "Answer briefly."
TURNS = [("What colour is the square?", "It is red."),
         ("And the circle next to it?", "The circle is blue, and larger.")]


def _conversation(system: bool):
    turns = [{"from": "system", "value": SYSTEM}] if system else []
    for question, answer in TURNS:
        turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    return turns


def _messages(turns):
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    return [{"role": roles[t["from"]], "content": t["value"]} for t in turns]


class _Image(ItemProcessor):
    """An image of `num_embeddings` placeholders, wrapped as Qwen2-VL writes it (or bare, as
    LLaVA writes it)."""

    def __init__(self, tokenizer, wrapped=True):
        names = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"] if wrapped else ["<image>"]
        ids = tokenizer.convert_tokens_to_ids(names)
        self.pad = ids[1] if wrapped else ids[0]
        self.wrap = ([ids[0]], [ids[2]]) if wrapped else ([], [])

    def process(self, item):
        return EncodedItem(inputs={}, num_embeddings=item)

    def tokens(self, item):
        return self.wrap[0] + [self.pad] * item.num_embeddings + self.wrap[1]


def _processor(tokenizer, template="auto", items=None):
    return SampleProcessor(tokenizer=tokenizer, family=Family(), item_processors=items or {},
                           markers={"vision": "<image>"} if items else {}, max_seq_len=4096,
                           template=resolve_template(template, tokenizer))


def _expected_mask(tokenizer, family, turns):
    """Tokens overlapping the characters each assistant turn renders as (HF's offsets)."""
    rendered = tokenizer.apply_chat_template(_messages(turns), tokenize=False)
    enc = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    spans, at = [], 0
    for t in turns:
        if t["from"] == "gpt":
            piece = FAMILIES[family][5].format(t["value"])
            start = rendered.index(piece, at)
            spans.append((start, start + len(piece)))
            at = start + len(piece)
    return enc["input_ids"], [any(a < e and b > s for s, e in spans)
                              for a, b in enc["offset_mapping"]]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ids_are_apply_chat_templates_and_the_mask_covers_assistant_turns(family):
    tok = make_tokenizer(family)
    system = family != "mistral"  # Mistral's template is not prefix-stable with one (below)
    turns = _conversation(system)
    sample = _processor(tok)(text=turns, media={}, sample_id="s1", source="chat")
    ids, mask = _expected_mask(tok, family, turns)
    assert sample.input_ids.tolist() == ids
    assert tok.apply_chat_template(_messages(turns))["input_ids"] == ids
    assert sample.loss_mask.tolist() == mask
    trained = tok.decode(sample.input_ids[sample.loss_mask], skip_special_tokens=True)
    assert trained.replace(" ", "") == "".join(a for _, a in TURNS).replace(" ", "")
    if system:
        assert SYSTEM in tok.decode(sample.input_ids)


def test_generation_blocks_give_hfs_assistant_mask():
    tok = make_tokenizer("qwen2_vl", QWEN2_VL_GENERATION)
    turns = _conversation(True)
    sample = _processor(tok)(text=turns, media={}, sample_id="s1", source="chat")
    hf = tok.apply_chat_template(_messages(turns), return_assistant_tokens_mask=True)
    assert sample.input_ids.tolist() == hf["input_ids"]
    assert sample.loss_mask.tolist() == [bool(m) for m in hf["assistant_masks"]]
    assert sum(hf["assistant_masks"]) > 0


def test_image_markers_expand_inside_the_rendered_text():
    """The marker stays in the content the template renders and becomes the family's tokens, as
    the processor expands its image token in the rendered prompt."""
    tok = make_tokenizer("qwen2_vl")
    turns = [{"from": "human", "value": "<image>\nDescribe the picture."},
             {"from": "gpt", "value": "A small green triangle on a white background."}]
    sample = _processor(tok, items={"vision": _Image(tok)})(
        text=turns, media={"vision": [3]}, sample_id="s1", source="chat")
    hf_content = [{"type": "image"}, {"type": "text", "text": "\nDescribe the picture."}]
    prompt = tok.apply_chat_template([{"role": "user", "content": hf_content},
                                      {"role": "assistant", "content": turns[1]["value"]}],
                                     tokenize=False)
    expanded = prompt.replace("<|image_pad|>", "<|image_pad|>" * 3)
    assert sample.input_ids.tolist() == tok(expanded, add_special_tokens=False)["input_ids"]
    assert [e for e, _ in sample.items] == ["vision"]
    proc = _processor(tok, items={"vision": _Image(tok)})
    size = proc.measure(text=turns, media={"vision": [3]}, sample_id="s1", source="chat")
    assert size.tokens == sample.length


def test_a_template_that_reads_only_lists_of_parts_gets_parts():
    """LLaVA-1.5's template renders a string content as nothing: contents go in as HF's parts
    (the marker an image part), as its processor's users write them; ids and assistant mask are
    HF's (its generation blocks), the image expanded as LlavaProcessor expands "<image>"."""
    from tests.family_dirs import demo_tokenizer
    from tests.chat_templates import LLAVA15
    tok = demo_tokenizer()
    tok.chat_template = LLAVA15
    assert not resolve_template("auto", tok).takes_strings
    caption = "A small green triangle on a white background."
    turns = [{"from": "human", "value": "<image>\nDescribe the image."},
             {"from": "gpt", "value": caption}]
    sample = _processor(tok, items={"vision": _Image(tok, wrapped=False)})(
        text=turns, media={"vision": [4]}, sample_id="s1", source="chat")
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "\nDescribe the image."}]},
                {"role": "assistant", "content": [{"type": "text", "text": caption}]}]
    prompt = tok.apply_chat_template(messages, tokenize=False)
    assert prompt.startswith("USER: <image>\n\nDescribe")
    expanded = tok(prompt.replace("<image>", "<image>" * 4), add_special_tokens=False)["input_ids"]
    assert sample.input_ids.tolist() == expanded
    hf = tok.apply_chat_template(messages, return_assistant_tokens_mask=True)
    image_id = tok.convert_tokens_to_ids("<image>")
    hf_mask = zip(hf["input_ids"], hf["assistant_masks"])
    assert sample.loss_mask.tolist() == [bool(m) for i, m in hf_mask
                                         for _ in range(4 if i == image_id else 1)]
    assert tok.decode(sample.input_ids[sample.loss_mask]) == caption + " "


def test_a_template_that_is_not_prefix_stable_is_an_error_naming_the_sample():
    tok = make_tokenizer("mistral")  # the system prompt goes into the last user turn
    with pytest.raises(SampleError, match=r"sample s7: the tokenizer's chat_template is not "
                                          r"prefix-stable.*assistant turn 2"):
        _processor(tok)(text=_conversation(True), media={}, sample_id="s7", source="chat")


def test_a_conversation_the_template_refuses_is_an_error_naming_the_sample():
    tok = make_tokenizer("gemma3")
    turns = [{"from": "human", "value": "What colour is the square?"},
             {"from": "human", "value": "Answer briefly."}, {"from": "gpt", "value": "It is red."}]
    with pytest.raises(SampleError, match="sample s9: the tokenizer's chat_template cannot render "
                                          "this conversation .*roles must alternate"):
        _processor(tok)(text=turns, media={}, sample_id="s9", source="chat")


def test_a_token_across_a_turn_boundary_is_an_error(tmp_path):
    """A prompt ending in a space: byte-level BPE writes the space into the answer's first token,
    so the mask's edge is inside a token."""
    path = tmp_path / "qa.jinja"
    path.write_text("{% for m in messages %}{% if m.role == 'user' %}Q: {{ m.content }}\n"
                    "{% else %}A: {{ m.content }}{{ eos_token }}\n{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}A: {% endif %}")
    tok = make_tokenizer("qwen2_vl")
    with pytest.raises(SampleError, match="sample s3: .* tokenises differently cut at a turn "
                                          "boundary than whole"):
        _processor(tok, str(path))(text=[{"from": "human", "value": "What colour is it?"},
                                         {"from": "gpt", "value": "red."}],  # "Ġred" is a token
                                   media={}, sample_id="s3", source="chat")


def test_template_choice(tmp_path):
    from ds_omni.config import DataConfig, SourceConfig
    tok = make_tokenizer("llama3")
    assert resolve_template("auto", tok).kind == "model"
    assert resolve_template("plain", tok).plain
    tok.chat_template = None
    assert resolve_template("auto", tok).plain
    with pytest.raises(ConfigError, match="tokenizer has no chat_template"):
        resolve_template("model", tok)
    src = [SourceConfig(name="s", path="x")]
    with pytest.raises(ConfigError, match="data.template='nope.jinja' is neither"):
        DataConfig(sources=src, template="nope.jinja")
    # a tokenizer that carries the plain template (an export of a plain run) stays plain
    tok.chat_template = resolve_template("plain", tok).source
    assert tok.chat_template.startswith(PLAIN_HEADER) and resolve_template("auto", tok).plain


def test_plain_export_reproduces_the_training_prompt(tmp_path):
    """The demo model (its tokenizer has no template, so it trains on "plain"): the export carries
    the plain template, and the exported processor's apply_chat_template gives the ids training
    put before the answer, image placeholders included."""
    import io
    from PIL import Image
    from transformers import AutoProcessor
    from ds_omni.data.demo import shapes_rows
    from ds_omni.data.templates import carry_template, training_template
    from ds_omni.model.build import build_model
    from ds_omni.model.convert import MODEL_META_DIR, export_hf, model_from_meta
    from ds_omni.train.checkpoint import save_model_meta
    from tests.fixtures import tiny_config
    built = build_model(tiny_config(str(tmp_path)).model)
    template = training_template("auto", built)
    assert template.plain
    carry_template(built.tokenizer, template)  # as `ds-omni train` does; then the way it exports:
    save_model_meta(tmp_path / "ckpt", built)  # the checkpoint's model/ folder
    _, meta_tokenizer = model_from_meta(tmp_path / "ckpt" / MODEL_META_DIR)
    export_hf(built.model, tmp_path / "hf", meta_tokenizer)
    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    row = shapes_rows(1, seed=3)[0]
    image = Image.open(io.BytesIO(row["image"]["bytes"])).convert("RGB")
    question = row["conversations"][0]["value"].split("\n", 1)[1]
    got = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": image},
                                      {"type": "text", "text": "\n" + question}]}],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    sample = SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                             item_processors=built.item_processors,
                             markers={"vision": "<image>"}, max_seq_len=128, template=template)(
        text=row["conversations"], media={"vision": [image]}, sample_id="x", source="s")
    prompt_len = int(sample.loss_mask.int().argmax())
    assert got["input_ids"][0].tolist() == sample.input_ids[:prompt_len].tolist()
    assert torch.allclose(got["pixel_values"][0], sample.items[0][1].inputs["pixel_values"])
