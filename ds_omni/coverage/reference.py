"""The HF side of the family checks and the coverage sweep, built apart from the code under test.

ds_omni's side of a check is `SampleProcessor` and `pack`; this module must not import them, so a
loss-mask or tokenisation bug cannot sit on both sides:
- `render` writes a conversation in a fixed format (`TEMPLATE`: bos, `USER: ...\\n`,
  `ASSISTANT:\\n...{eos}\\n`, which the sweep puts on its tokenizers) or in ds_omni's plain one,
  noting where each assistant span lies; HF's processor then tokenises the whole text;
- `token_mask` marks the tokens HF produced inside the assistant spans;
- `hf_loss` and `assert_grads_match` compare loss and every gradient.
Only these two formats are written; another chat template is refused, not guessed at. The sweep
uses `TEMPLATE` (its prompt ends at a newline: the plain format's "ASSISTANT: " space is its own
token, which HF's whole-text tokenising does not reproduce).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-6
LOSS_RTOL = 1e-6
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}USER: {{ m.content }}\n"
            "{% elif m.role == 'assistant' %}ASSISTANT:\n{{ m.content }}{{ eos_token }}\n"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")
"""The chat template `render(..., templated=True)` writes out (in Python, not through Jinja)."""


def render(text, tokenizer, marker: str = "<image>", image_text: str = "<image>",
           templated: bool = False, plain: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, trained character spans) of a sample's text.

    `text`: a conversation (list of {"from"/"role", "value"/"content"}) or a plain string (trained
    whole, its eos too). `marker` in the text is written as `image_text` (what HF's processor
    expands). `templated`: in `TEMPLATE`'s format (the tokenizer must carry it), else plain (on a
    tokenizer without a template, or `plain`: the samples were made with the plain format)."""
    own = getattr(tokenizer, "chat_template", None)
    if not plain and own != (TEMPLATE if templated else None):
        raise ValueError("coverage.reference renders `TEMPLATE` (templated=True, on a tokenizer "
                         "carrying it) or the plain format (on one without a chat template); "
                         f"this tokenizer's chat_template is {str(own)[:80]!r}")
    bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""
    if isinstance(text, str):
        body = text.replace(marker, image_text) + eos
        return bos + body, [(len(bos), len(bos) + len(body))]
    out, spans = bos, []
    for turn in text:
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content")).replace(marker, image_text)
        if role in ("gpt", "assistant"):
            out += "ASSISTANT:\n" if templated else "ASSISTANT: "
            spans.append((len(out), len(out) + len(content) + len(eos)))
            out += content + eos + "\n"
        else:
            out += ("USER: " if role in ("human", "user") else "") + content + "\n"
    return out, spans


def token_mask(ids: list[int], rendered: str, spans: list[tuple[int, int]], tokenizer,
               item_texts: tuple[str, ...] = ("<image>",)) -> torch.Tensor:
    """[L] bool: token k of `ids` (HF's processor output for `rendered`) lies in a trained span.

    The ids decode to `rendered` with each item (written as one of `item_texts`) expanded as the
    processor expanded it, so a span is found as its text together with the text before it back
    to the last item (which holds none, so it is in the decoded ids as it is in `rendered`)."""
    ends = [len(tokenizer.decode(ids[:k], clean_up_tokenization_spaces=False))
            for k in range(len(ids) + 1)]
    decoded = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    mask, at, done = torch.zeros(len(ids), dtype=torch.bool), 0, 0
    for start, end in spans:
        inside = [rendered.rfind(t, start, end) + len(t) for t in item_texts
                  if t and t in rendered[start:end]]
        start = max([start, *inside])  # an item's own tokens are not predicted
        after_item = [rendered.rfind(t, 0, start) + len(t) for t in item_texts
                      if t and t in rendered[:start]]
        anchor = max([done, *after_item])
        found = decoded.find(rendered[anchor:end], at)
        if found < 0:
            raise AssertionError(f"the trained text {rendered[start:end]!r} is not in HF's tokens "
                                 f"as they decode: {decoded[-200:]!r}")
        first, last = found + start - anchor, found + end - anchor
        for k in range(len(ids)):
            a, b = ends[k], ends[k + 1]
            if a < first < b or a < last < b:
                raise AssertionError(f"a trained span's edge cuts token {k} ({decoded[a:b]!r}) "
                                     f"of HF's tokens")
            mask[k] |= first <= a and b <= last and b > a
        at, done = last, end
    return mask


def hf_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple:
    """(summed token loss, target count): token t predicted from t-1 where `mask[t]`.
    logits [L, V], ids [L], mask [L]."""
    targets = torch.where(mask[1:], ids[1:], torch.full_like(ids[1:], -100))
    loss = F.cross_entropy(logits[:-1].float(), targets, reduction="sum", ignore_index=-100)
    return loss, int(mask[1:].sum())


def grad_problems(reference, ours: dict[str, torch.nn.Parameter], key_map: dict[str, str],
                  rtol: float = GRAD_RTOL, atol: float = GRAD_ATOL) -> tuple[list[str], int]:
    """(what differs, how many gradients compared) between every trainable HF parameter's
    gradient and the OmniModel parameter `key_map` maps it to; one without a gradient on the HF
    side must have none, or zeros, on ours."""
    bad, checked = [], 0
    for hf_key, param in reference.named_parameters():
        if not param.requires_grad:
            continue
        mine = ours[key_map[hf_key]].grad
        if param.grad is None:
            if mine is not None and mine.any():
                bad.append(f"{hf_key}: no gradient in HF, {mine.abs().max():.2g} in ds_omni")
            continue
        if mine is None:
            if param.grad.any():
                bad.append(f"{hf_key}: no gradient in ds_omni")
            continue
        if not torch.allclose(mine, param.grad, rtol=rtol, atol=atol):
            gap = (mine - param.grad).abs().max().item()
            bad.append(f"{hf_key}: gradients differ by {gap:.2g}")
        checked += 1
    return bad, checked
