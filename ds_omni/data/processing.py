"""Raw rows -> `Sample`s: tokens with expanded placeholders, loss mask, positions, encoder items.

A conversation is rendered with the run's chat template (`templates.py`); the "plain" template is
rendered here turn by turn, `<s>USER: {human}\\nASSISTANT: {assistant}</s>\\n`, only assistant text
and its end-of-sequence token trained on. A plain-text column is trained on whole. Each `<image>`
/ `<audio>` marker becomes as many placeholder tokens as its item yields embeddings (the family's
item processor says how many). A text that is a string holding a JSON conversation is parsed, or
an error, as the schema's `conversation_strings` says. Non-square images are padded or stretched
first when `data.image_aspect` asks. More: docs/data.md, "Chat templates".
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_omni.batch import EncodedItem, ItemProcessor, SampleFamily, feeds
from ds_omni.data.media import image_size, square_image
from ds_omni.data.problems import SampleError
from ds_omni.data.templates import (ChatTemplate, first_difference, render,
                                    resolve_template, to_messages)
from ds_omni.errors import DataError

ROLE_PREFIX = {"user": "USER: ", "assistant": "ASSISTANT: ", "system": ""}
_KIND_NAMES = {"vision": "images", "audio": "audio clips", "video": "videos"}


@dataclass
class Sample:
    """One tokenised sample. Dims: L tokens."""

    sample_id: str
    source: str
    input_ids: torch.Tensor  # [L]
    loss_mask: torch.Tensor  # [L] bool: this token is predicted (from the one before it)
    position_ids: torch.Tensor  # [L] or [3, L]
    # (encoder, item) in text order; the encoder its processor feeds (a video's may be "vision")
    items: list[tuple[str, EncodedItem]] = field(default_factory=list)
    # (start, end) spans attended both ways (`SampleFamily.attention_blocks`); empty: causal
    blocks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_targets(self) -> int:
        # the first token is never a target: nothing precedes it
        return int(self.loss_mask[1:].sum())


@dataclass(frozen=True)
class SampleSize:
    """What balancing needs to know of a sample, found without decoding its media."""

    tokens: int
    encoder_seqs: tuple[tuple[str, int], ...]  # (encoder, sequence length) per encoder pass


class SampleProcessor:
    """Turns rows into `Sample`s for one model (its tokenizer and its family's item processors).

    The raw text marks where each item goes with a marker string ("<image>", "<audio>"); the text
    is split on the markers before tokenising and each marker is replaced by the tokens its item's
    processor gives (its placeholder token repeated once per embedding, plus any wrapper tokens),
    so the tokenizer needs no marker token of its own.

    `template`: the chat template conversations are rendered with; default: the tokenizer's own,
    or "plain" for a tokenizer without one (`templates.resolve_template("auto", ...)`).
    """

    def __init__(self, *, tokenizer, family: SampleFamily, item_processors: dict[str, ItemProcessor],
                 markers: dict[str, str], max_seq_len: int, overlong: str = "error",
                 conversation_strings: str = "parse", image_aspect: str = "crop",
                 template: ChatTemplate | None = None, max_image_pixels: int | None = None):
        self.tokenizer = tokenizer
        self.template = template or resolve_template("auto", tokenizer)
        self.conversation_strings = conversation_strings
        self.image_aspect = image_aspect
        self.max_image_pixels = max_image_pixels
        self.family = family
        self.item_processors = item_processors
        self.max_seq_len = max_seq_len
        self.overlong = overlong
        self.markers = {m: enc for enc, m in markers.items()}  # marker string -> encoder name
        self._split = re.compile("(" + "|".join(re.escape(m) for m in self.markers) + ")")
        # A sample is tokenised twice (measured on the rank that reads it, processed on the rank
        # that trains on it), and role prefixes and prompts repeat: remember recent pieces.
        self._encode = functools.lru_cache(maxsize=8192)(self._encode_piece)

    def __getstate__(self) -> dict:  # sent to data workers: the cache stays behind
        return {k: v for k, v in self.__dict__.items() if k != "_encode"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._encode = functools.lru_cache(maxsize=8192)(self._encode_piece)

    def _encode_piece(self, piece: str, continued: bool = False) -> tuple[int, ...]:
        """`continued`: the piece follows other text, so a tokenizer that marks the start of its
        input (SentencePiece's prefix space) must not mark it; encoded after a newline that is
        then dropped, as transformers does for the same problem."""
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        if continued:
            newline, ids = encode("\n"), encode("\n" + piece)
            if ids[:len(newline)] == newline:
                return tuple(ids[len(newline):])
        return tuple(encode(piece))

    # ------------------------------------------------------------------------------ public
    def __call__(self, *, text: Any, media: dict[str, list[Any]], sample_id: str,
                 source: str) -> Sample:
        """`text`: a conversation (list of {"from", "value"}) or a string; `media`: kind of item
        ("vision", "audio", "video": the keys of `item_processors` and `markers`) -> items."""
        ids, mask, ordered = self._build(text, media, sample_id, source, measure=False)
        input_ids = torch.tensor(ids, dtype=torch.long)
        loss_mask = torch.tensor(mask, dtype=torch.bool)
        return Sample(sample_id=sample_id, source=source, input_ids=input_ids, loss_mask=loss_mask,
                      position_ids=self.family.position_ids(input_ids, ordered), items=ordered,
                      blocks=self.family.attention_blocks(input_ids, loss_mask))

    def measure(self, *, text: Any, media: dict[str, list[Any]], sample_id: str,
                source: str) -> SampleSize:
        """The sample's token count and encoder work, through the items' `measure`."""
        ids, _, ordered = self._build(text, media, sample_id, source, measure=True)
        return SampleSize(tokens=len(ids), encoder_seqs=tuple(
            (enc, n) for enc, item in ordered for n in item.cost_seqs()))

    # ----------------------------------------------------------------------------- helpers
    def _build(self, text, media, sample_id, source, measure: bool):
        where = f"source '{source}' sample {sample_id}"
        for enc in media:
            if enc not in self.item_processors:
                raise SampleError(f"{where} has {_KIND_NAMES.get(enc, enc)} but this model "
                                  f"({self.family.name}) takes none; leave that column out of "
                                  "the source's schema or pick a model that takes them", "other")
        items = {enc: [self._item(enc, x, where, measure) for x in xs] for enc, xs in media.items()}
        segments, rendered = self._segments(text, where)
        ids, mask, ordered, items_end = self._tokenize(segments, items, where, bos=not rendered)
        if rendered:
            self._check_cuts(segments, ids, items, where)
        ids, mask = self._fit(ids, mask, items_end, where)
        return ids, mask, ordered

    def _check_cuts(self, segments, ids, items, where) -> None:
        """The text cut where trained spans begin and end tokenises to the ids of the whole (as
        `apply_chat_template` tokenises it), so the mask's edges are token edges and every prompt
        tokenises as it will when served."""
        whole = self._tokenize([("".join(s for s, _ in segments), False)], items, where,
                               bos=False)[0]
        if whole == ids:
            return
        at = first_difference(whole, ids)
        cut = self.tokenizer.decode(whole[max(0, at - 3):at + 3])
        raise SampleError(f"{where}: with {self.template.origin}, the text around token {at} "
                          f"({cut!r}) tokenises differently cut at a turn boundary than whole: "
                          "the template is not prefix-stable for this tokenizer (a token spans "
                          "the end of a prompt and the start of its answer). Use a template "
                          "that ends each prompt and each answer at a special token or a newline, "
                          "or set data.template to \"plain\"", "template")

    def _item(self, enc: str, item: Any, where: str, measure: bool) -> EncodedItem:
        """One raw item through its processor; its DataError gets the sample's name (the item
        processor sees only the item)."""
        proc = self.item_processors[enc]
        try:
            if proc.modality == "image" and self.max_image_pixels is not None:
                image_size(item, self.max_image_pixels)  # the header: refused before decoding
            if self.image_aspect != "crop" and proc.modality == "image" and not (
                    measure and _header_measure(proc)):
                item = square_image(item, self.image_aspect, _mean_colour(proc))
            return proc.measure(item) if measure else proc.process(item)
        except DataError as e:
            from ds_omni.data.problems import kind_of
            raise SampleError(f"{where}: {e}", kind_of(e)) from None

    def _segments(self, text, where) -> tuple[list[tuple[str, bool]], bool]:
        """(text, trained-on) pieces in order; and whether a chat template rendered them (its
        text holds the bos token, if any)."""
        eos = self.tokenizer.eos_token or ""
        if isinstance(text, str) and self.conversation_strings != "text":
            turns = conversation_string(text)
            if turns is not None and self.conversation_strings == "error":
                raise SampleError(f"{where}: the text is a string holding a JSON conversation; "
                                  "trained as plain text every token would be a target. Store it "
                                  "as a list, or set schema.conversation_strings to \"parse\"",
                                  "conversation_string")
            text = turns if turns is not None else text
        if isinstance(text, str):
            if not text.strip():
                raise SampleError(f"{where}: empty text", "text")
            return [(text + eos, True)], False
        if not isinstance(text, list) or not text:
            raise SampleError(f"{where}: expected a conversation (a list of {{'from', 'value'}} "
                              f"turns) or a string, got {type(text).__name__}", "text")
        messages = to_messages(text, where)
        if not self.template.plain:
            modality = {m: self.item_processors[enc].modality for m, enc in self.markers.items()
                        if enc in self.item_processors}
            return render(self.template, self.tokenizer, messages, where, modality), True
        segments = []
        for m in messages:
            if m["role"] == "assistant":
                segments += [(ROLE_PREFIX["assistant"], False), (m["content"] + eos, True),
                             ("\n", False)]
            else:
                segments.append((ROLE_PREFIX[m["role"]] + m["content"] + "\n", False))
        return segments, False

    def _tokenize(self, segments, items: dict[str, list[EncodedItem]], where, bos: bool = True):
        """Token ids, loss mask, the items in text order, and where the last item's tokens end.
        Pieces after the first are encoded as continuations when a chat template rendered them."""
        bos_id = self.tokenizer.bos_token_id if bos else None
        ids = [bos_id] if bos_id is not None else []
        mask = [False] * len(ids)
        ordered: list[tuple[str, EncodedItem]] = []
        used = {enc: 0 for enc in items}
        items_end = 0
        last_item = None  # the encoder of the item just written, while no text follows it
        for text, trained in segments:
            for piece in self._split.split(text) if self.markers else [text]:
                enc = self.markers.get(piece)
                if enc is None:
                    toks = self._encode(piece, not bos and bool(ids)) if piece else []
                    ids += toks
                    mask += [trained] * len(toks)
                    last_item = last_item if not toks else None
                    continue
                if used.get(enc, 0) >= len(items.get(enc, [])):
                    raise SampleError(f"{where}: more {piece} markers than {enc} items "
                                      f"({len(items.get(enc, []))})", "markers", enc)
                item = items[enc][used[enc]]
                used[enc] += 1
                ordered.append((feeds(self.item_processors, enc), item))
                proc = self.item_processors[enc]
                if last_item == enc and proc.shared_tail:  # adjacent items share one tail
                    del ids[-proc.shared_tail:], mask[-proc.shared_tail:]
                toks = proc.tokens_at(item, used[enc] - 1)
                ids += toks
                mask += [False] * len(toks)
                items_end = len(ids)
                last_item = enc
        for enc, xs in items.items():
            if used[enc] != len(xs):
                raise SampleError(f"{where}: {len(xs)} {enc} items but {used[enc]} markers in the "
                                  "text; put one marker per item where it belongs", "markers", enc)
        return ids, mask, ordered, items_end

    def _fit(self, ids, mask, items_end, where):
        if len(ids) <= self.max_seq_len:
            return ids, mask
        if self.overlong == "error" or items_end > self.max_seq_len:
            raise SampleError(f"{where} has {len(ids)} tokens, more than data.max_seq_len="
                              f"{self.max_seq_len}; raise max_seq_len or set data.overlong="
                              "'truncate' (items are never cut); `ds-omni data check` lists them "
                              "all", "overlong")
        return ids[: self.max_seq_len], mask[: self.max_seq_len]



def conversation_string(text: str) -> list | None:
    """The turns of a string that is a JSON conversation ('[{"from": ..., "value": ...}, ...]')."""
    head = text.lstrip()[:1]
    if head != "[":
        return None
    try:
        turns = json.loads(text)
    except ValueError:
        return None
    if isinstance(turns, list) and turns and all(
            isinstance(t, dict) and ("from" in t or "role" in t) for t in turns):
        return turns
    return None


def _header_measure(proc: ItemProcessor) -> bool:
    """The processor measures from the image header alone (its size does not depend on the
    aspect: every image becomes the tower's square), so measuring needs no squared copy."""
    return type(proc).measure is not ItemProcessor.measure


def _mean_colour(proc: ItemProcessor) -> tuple[int, int, int]:
    """The processor's normalisation mean as an RGB colour (what "pad" fills with)."""
    hf = getattr(proc, "hf_processor", None)
    mean = getattr(hf, "image_mean", None) or getattr(getattr(hf, "image_processor", None),
                                                       "image_mean", None) or (0.5, 0.5, 0.5)
    return tuple(int(round(m * 255)) for m in mean)
