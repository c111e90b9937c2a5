"""Chat templates: how a conversation becomes text, and which characters of it are trained on.

`data.template` (`resolve_template`): "model" (the tokenizer's own, rendered as
`apply_chat_template` does), a Jinja file's path, "plain" (`USER: ... ASSISTANT: ...`, rendered in
`processing.py`), or "auto" ("model" when the tokenizer has one). Trained characters: a template's
`{% generation %}` blocks, else the assistant turns found by rendering growing prefixes of the
conversation; each sample is checked to be prefix-stable and to tokenise the same cut as whole,
else an error naming it. `<image>` / `<audio>` markers stay in the contents (a template that reads
only lists of parts gets HF's parts). The template used is carried on the tokenizer
(`carry_template`), so checkpoints and HF exports reproduce the training prompt.
More: docs/data.md, "Chat templates".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ds_omni.batch import EncodedItem
from ds_omni.config import check_template_spec
from ds_omni.data.problems import SampleError
from ds_omni.errors import ConfigError

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "system": "system"}
PLAIN_HEADER = "{#- ds_omni plain template: USER: ... ASSISTANT: ... -#}"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class ChatTemplate:
    """The template a run renders conversations with."""

    kind: str
    """"plain", "model" (the tokenizer's) or "file"."""
    source: str
    """The Jinja text; for "plain", its Jinja equivalent (what exports carry)."""
    origin: str = ""
    """Where it came from, for error messages."""
    takes_strings: bool = True
    """The template renders string contents; if not (LLaVA-1.5's, Idefics3's: they read only
    lists of parts), contents are given as parts, markers becoming image / audio parts."""
    media_text: dict[str, str] = field(default_factory=dict)
    """Per modality, the text an item's part renders as, which the model's processor expands
    ("<image>"); the source's marker takes its place before the item's tokens go in."""

    @property
    def plain(self) -> bool:
        return self.kind == "plain"

    @property
    def marks_generation(self) -> bool:
        """The template wraps assistant text in `{% generation %}` blocks."""
        return bool(_GENERATION_TAG.search(self.source))


def plain_template_source(media_text: dict[str, str] | None = None) -> str:
    """The plain format as a Jinja chat template (for exports: `processing.py` renders it itself).

    Each turn: `USER: {text}\\n`, `ASSISTANT: {text}{eos}\\n` (the assistant text and eos in a
    generation block), a system turn as its text and a newline; `bos` first. Content given as a
    list of parts (HF's multimodal messages) writes each image or audio part as `media_text` says:
    the text the exported processor expands into the item's placeholders.
    """
    media = {"image": "<image>", "audio": "<audio>", **(media_text or {})}
    part = ("{%- for p in m.content -%}{%- if p.type == 'text' -%}{{ p.text }}"
            + "".join(f"{{%- elif p.type == '{k}' -%}}{{{{ {_jinja_str(v)} }}}}"
                      for k, v in sorted(media.items()))
            + "{%- endif -%}{%- endfor -%}")
    content = ("{%- if m.content is string -%}{{ m.content }}{%- else -%}" + part
               + "{%- endif -%}")
    return (PLAIN_HEADER + "{{- bos_token -}}{%- for m in messages -%}"
            "{%- if m.role == 'system' -%}" + content + "{{- '\\n' -}}"
            "{%- elif m.role == 'user' -%}{{- 'USER: ' -}}" + content + "{{- '\\n' -}}"
            "{%- else -%}{{- 'ASSISTANT: ' -}}{% generation %}" + content
            + "{{- eos_token -}}{% endgeneration %}{{- '\\n' -}}{%- endif -%}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- 'ASSISTANT: ' -}}{%- endif -%}")


def _jinja_str(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def resolve_template(spec: str, tokenizer,
                     media_text: dict[str, str] | None = None) -> ChatTemplate:
    """The template `spec` ("auto", "model", "plain" or a Jinja file) means for `tokenizer`.

    A template that is the export of a "plain" run (it starts with `PLAIN_HEADER`) renders as
    "plain" did, so training on from such an export keeps the tokenisation it had."""
    check_template_spec(spec)
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one is the chat format
        own = own.get("default")
    if spec == "plain" or (spec == "auto" and not own):
        return ChatTemplate("plain", plain_template_source(media_text), "data.template=\"plain\"")
    if spec in ("auto", "model"):
        if not own:
            raise ConfigError("data.template=\"model\" but the tokenizer has no chat_template; "
                              "set data.template to \"plain\" (USER: ... ASSISTANT: ...) or to "
                              "the path of a Jinja chat template")
        kind, source, origin = "model", own, "the tokenizer's chat_template"
    else:
        kind, source, origin = "file", Path(spec).read_text(), f"data.template={spec!r}"
    if source.startswith(PLAIN_HEADER):
        return ChatTemplate("plain", source, origin)
    return ChatTemplate(kind, source, origin, _takes_strings(source, tokenizer),
                        {"image": "<image>", "audio": "<audio>", **(media_text or {})})


PROBE = ("ds-omni-probe-question", "ds-omni-probe-answer")


def _takes_strings(source: str, tokenizer) -> bool:
    """The template writes string contents out (many multimodal ones iterate the content as a
    list of parts, and a string's characters render as nothing)."""
    from transformers.utils.chat_template_utils import render_jinja_template
    probe = [{"role": "user", "content": PROBE[0]}, {"role": "assistant", "content": PROBE[1]}]
    try:
        text = render_jinja_template(conversations=[probe], chat_template=source,
                                     **tokenizer.special_tokens_map)[0][0]
    except Exception:  # noqa: BLE001  (the samples will say what the template refuses)
        return True
    return all(p in text for p in PROBE)


def training_template(spec: str, built) -> ChatTemplate:
    """The template a run with `data.template=spec` renders with, for a built model."""
    media = media_texts(built.item_processors, built.tokenizer)
    return resolve_template(spec, built.tokenizer, media)


def carry_template(tokenizer, template: ChatTemplate) -> None:
    """Make `template` the tokenizer's chat template, so what is saved from it carries it."""
    tokenizer.chat_template = template.source


def media_texts(item_processors: dict, tokenizer) -> dict[str, str]:
    """Per modality, the text one item stands as in the model's prompts (its processor expands it):
    the family's item tokens for a one-embedding item, decoded ("<image>" for LLaVA,
    "<|vision_start|><|image_pad|><|vision_end|>" for Qwen2-VL)."""
    out = {}
    for proc in item_processors.values():
        try:
            ids = proc.tokens(EncodedItem(inputs={}, num_embeddings=1))
        except (KeyError, AttributeError, TypeError, ValueError):  # tokens that need a real item
            continue  # the marker ("<image>") stands for it
        out[proc.modality] = tokenizer.decode(ids, skip_special_tokens=False)
    return out


# ----------------------------------------------------------------------------------- rendering
def to_messages(turns: list, where: str) -> list[dict]:
    """LLaVA/ShareGPT turns ({"from", "value"}) or chat messages ({"role", "content"}) -> chat
    messages with roles system / user / assistant."""
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise SampleError(f"{where}: bad turn {turn!r}; turns are objects", "text")
        role, value = turn.get("from") or turn.get("role"), turn.get("value") or turn.get("content")
        if role not in ROLES or not isinstance(value, str):
            raise SampleError(f"{where}: bad turn {turn!r}; turns need 'from' in {sorted(ROLES)} "
                              "and a string 'value'", "text")
        messages.append({"role": ROLES[role], "content": value})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise SampleError(f"{where}: no assistant turn to train on", "text")
    return messages


def render(template: ChatTemplate, tokenizer, messages: list[dict], where: str,
           markers: dict[str, str] | None = None) -> list[tuple[str, bool]]:
    """The conversation rendered, as (text, trained) pieces: the assistant turns trained.

    `markers`: marker string -> modality ("<image>" -> "image"); items stay marked by them in the
    pieces, whatever the template writes for an item."""
    markers = markers or {}
    if not template.takes_strings:
        messages = [{**m, "content": _parts(m["content"], markers)} for m in messages]
    if template.marks_generation:
        text, spans = _render(template, tokenizer, messages, where, generation=True)
    else:
        text, _ = _render(template, tokenizer, messages, where)
        spans = _prefix_spans(template, tokenizer, messages, text, where)
    if not spans:
        raise SampleError(f"{where}: {template.origin} renders none of this conversation's "
                          "assistant text (a template with {% generation %} blocks must wrap each "
                          "assistant message in one)", "template")
    pieces = _cut(text, spans)
    if not template.takes_strings:
        pieces = [(_marked(p, template.media_text, markers), t) for p, t in pieces]
    return pieces


def _parts(content: str, markers: dict[str, str]) -> list[dict]:
    """A string content as HF's list of parts: text, and an image / audio part per marker."""
    if not markers:
        return [{"type": "text", "text": content}]
    split = re.split("(" + "|".join(map(re.escape, markers)) + ")", content)
    return [{"type": markers[s]} if s in markers else {"type": "text", "text": s}
            for s in split if s]


def _marked(text: str, media_text: dict[str, str], markers: dict[str, str]) -> str:
    """The template's text for each item replaced by the item's marker."""
    for marker, modality in markers.items():
        written = media_text.get(modality)
        if written and written != marker:
            text = text.replace(written, marker)
    return text


def _cut(text: str, spans: list[tuple[int, int]]) -> list[tuple[str, bool]]:
    """`text` as (piece, trained) pieces: the spans trained, the rest not; empty pieces dropped."""
    pieces, at = [], 0
    for start, end in spans:
        pieces += [(text[at:start], False), (text[start:end], True)]
        at = end
    pieces.append((text[at:], False))
    return [(p, trained) for p, trained in pieces if p]


def _prefix_spans(template, tokenizer, messages, whole: str, where: str) -> list[tuple[int, int]]:
    """Assistant spans from growing prefixes (see the module docstring)."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, _ = _render(template, tokenizer, messages[:i], where, add_generation_prompt=True)
        upto, _ = _render(template, tokenizer, messages[: i + 1], where)
        for part, name in ((prompt, "the prompt before"), (upto, "the conversation up to")):
            if not whole.startswith(part) or not upto.startswith(prompt):
                raise SampleError(_not_prefix_stable(template, where, i, name, part, whole),
                                  "template")
        end = len(upto.rstrip())
        if end > len(prompt):
            spans.append((len(prompt), end))
    return spans


def _not_prefix_stable(template, where, i, name, part, whole) -> str:
    at = first_difference(part, whole)
    return (f"{where}: {template.origin} is not prefix-stable: {name} assistant turn {i}, rendered "
            f"alone, is not the start of the whole conversation rendered (they part at character "
            f"{at}: {part[at:at + 40]!r} vs {whole[at:at + 40]!r}), so what trains would not be "
            "the prompt the model is served with. Use a template that renders earlier turns the "
            "same whatever follows them (some move the system prompt into the last user turn, or "
            "drop reasoning from earlier turns), mark the assistant text with {% generation %} "
            "blocks, or set data.template to another template or \"plain\"")


def first_difference(a, b) -> int:
    """The first index where sequences `a` and `b` differ (the shorter one's length if none)."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _render(template: ChatTemplate, tokenizer, messages, where, add_generation_prompt=False,
            generation=False) -> tuple[str, list[tuple[int, int]]]:
    """One rendering through transformers' own Jinja renderer (what `apply_chat_template` uses,
    with the tokenizer's special tokens as variables)."""
    from transformers.utils.chat_template_utils import render_jinja_template
    try:
        texts, spans = render_jinja_template(
            conversations=[messages], chat_template=template.source,
            add_generation_prompt=add_generation_prompt, return_assistant_tokens_mask=generation,
            **tokenizer.special_tokens_map)
    except Exception as e:  # noqa: BLE001  (Jinja errors and the template's raise_exception)
        raise SampleError(f"{where}: {template.origin} cannot render this conversation "
                          f"({type(e).__name__}: {e}); fix the conversation's roles or set "
                          "data.template to a template that takes it", "template") from None
    return texts[0], list(spans[0]) if generation else []
