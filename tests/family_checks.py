"""Parity checks shared by the family tests: OmniModel against the HF model it was loaded from.

A family test builds a tiny random HF model, saves it with `save_pretrained` (plus tokenizer and
processor files), then compares:
- the reference: the HF class loaded fresh from that directory with plain `from_pretrained`, run
  one sample at a time on the inputs its own processor would produce;
- ds_omni: `build_model(ModelConfig(pretrained=dir))`, all samples packed into one micro-batch.
The reference's loss mask is not ds_omni's: `ds_omni.coverage.reference` renders each
sample's raw text (kept on the sample by `processor_for`'s processor) in the plain format and
marks the reference's tokens that lie in the assistant spans.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ds_omni.batch import MicroBatch
from ds_omni.config import ModelConfig
from ds_omni.coverage import reference as oracle
from ds_omni.data.packing import pack
from ds_omni.data.processing import Sample, SampleProcessor
from ds_omni.model.build import BuiltModel, build_model

LOGITS_ATOL = 1e-5


def save_hf(hf_model, tokenizer, out: Path, processor=None) -> Path:
    """Write an HF directory the way users have them: weights, config, tokenizer, processor."""
    hf_model.save_pretrained(str(out), safe_serialization=True)
    (processor or tokenizer).save_pretrained(str(out))
    return out


def load_omni(model_dir: Path, **model_cfg) -> BuiltModel:
    return build_model(ModelConfig(pretrained=str(model_dir), **model_cfg))


MARKERS = {"vision": "<image>", "audio": "<audio>"}
VIDEO_MARKERS = {"vision": "<image>", "video": "<video>"}


class KeepingText(SampleProcessor):
    """A SampleProcessor whose samples keep their raw text (`reference_text`), which the
    reference renders itself."""

    def __call__(self, *, text, **kwargs) -> Sample:
        sample = super().__call__(text=text, **kwargs)
        sample.reference_text = text
        return sample


def processor_for(built: BuiltModel, max_seq_len: int = 4096,
                  markers: dict[str, str] = MARKERS) -> SampleProcessor:
    """The samples' processor: the plain format, which the reference renders itself (a family
    whose tokenizer has a chat template, Qwen2-Audio's, is checked on the plain format too)."""
    from ds_omni.data.templates import resolve_template
    return KeepingText(tokenizer=built.tokenizer, family=built.family,
                       item_processors=built.item_processors, markers=markers,
                       max_seq_len=max_seq_len, template=resolve_template("plain", built.tokenizer))


def reference_mask(built: BuiltModel, sample: Sample, ids: torch.Tensor) -> torch.Tensor:
    """[L] the reference's loss mask over its token ids `ids` [L]: the tokens inside the
    assistant spans of the sample's text rendered apart from ds_omni (`coverage.reference`)."""
    text, spans = oracle.render(sample.reference_text, built.tokenizer, plain=True)
    return oracle.token_mask(ids.tolist(), text, spans, built.tokenizer,
                             tuple({*MARKERS.values(), *VIDEO_MARKERS.values()}))


def omni_logits(built: BuiltModel, samples: list[Sample]) -> tuple[MicroBatch, list[torch.Tensor]]:
    """Per-sample logits [L, V] computed from ONE packed micro-batch of all samples."""
    mb = pack(samples, built.item_processors)
    logits = built.model.logits(mb)[0]
    cu = mb.cu_seqlens.tolist()
    return mb, [logits[a:b] for a, b in zip(cu[:-1], cu[1:])]


def assert_logits_match(built: BuiltModel, reference, samples: list[Sample],
                        hf_inputs: Callable[[Sample], dict]) -> float:
    """Max |omni - HF| over all samples' logits; asserts it is at most LOGITS_ATOL."""
    with torch.no_grad():
        _, ours = omni_logits(built, samples)
        worst = 0.0
        for sample, got in zip(samples, ours):
            ref = reference(**hf_inputs(sample)).logits[0]
            assert ref.shape == got.shape, (sample.sample_id, ref.shape, got.shape)
            worst = max(worst, (ref - got).abs().max().item())
    assert worst <= LOGITS_ATOL, f"logits differ by {worst:.3g} (> {LOGITS_ATOL})"
    return worst


def assert_loss_and_grads_match(built: BuiltModel, reference, samples: list[Sample],
                                hf_inputs: Callable[[Sample], dict], rtol=oracle.GRAD_RTOL,
                                atol=oracle.GRAD_ATOL) -> None:
    """Same mean token loss, and the same gradient on every trainable parameter (mapped by HF
    key), with the reference's loss over the tokens `reference_mask` marks."""
    reference.zero_grad()
    ref_loss, total = 0.0, 0
    for s in samples:
        inputs = hf_inputs(s)
        logits = reference(**inputs).logits[0]
        loss, count = oracle.hf_loss(logits, inputs["input_ids"][0],
                                     reference_mask(built, s, inputs["input_ids"][0]))
        ref_loss, total = ref_loss + loss, total + count
    (ref_loss / total).backward()

    model = built.model
    model.zero_grad()
    out = model(pack(samples, built.item_processors))
    (out.loss_sum / out.num_targets).backward()
    assert int(out.num_targets) == total, (int(out.num_targets), total)
    torch.testing.assert_close(out.loss_sum / out.num_targets, ref_loss / total,
                               rtol=oracle.LOSS_RTOL, atol=1e-6)
    bad, checked = oracle.grad_problems(reference, dict(model.named_parameters(
        remove_duplicate=False)), model.hf_key_map(), rtol=rtol, atol=atol)
    assert not bad and checked > 0, bad


def assert_round_trip(built: BuiltModel, out_dir: Path, reference) -> None:
    """Export -> same keys, bitwise-equal tensors as the HF model the OmniModel came from."""
    from ds_omni.model.convert import export_hf
    export_hf(built.model, out_dir, built.tokenizer, model_dir=built.model_dir)
    exported = type(reference).from_pretrained(str(out_dir))
    ref_state, exp_state = reference.state_dict(), exported.state_dict()
    assert ref_state.keys() == exp_state.keys()
    for key in ref_state:
        assert torch.equal(ref_state[key], exp_state[key]), key
