"""Parity checks shared by the family tests: OmniModel against the HF model it was loaded from.

A family test builds a tiny random HF model, saves it with `save_pretrained` (plus tokenizer and
processor files), then compares:
- the reference: the HF class loaded fresh from that directory with plain `from_pretrained`, run
  one sample at a time on the inputs its own processor would produce;
- ds_omni: `build_model(ModelConfig(pretrained=dir))`, all samples packed into one micro-batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ds_omni.config import ModelConfig
from ds_omni.data.packing import MicroBatch, pack, sample_targets
from ds_omni.data.processing import Sample, SampleProcessor
from ds_omni.model.build import BuiltModel, build_model
from ds_omni.model.omni import IGNORE_INDEX

LOGITS_ATOL = 1e-5


def save_hf(hf_model, tokenizer, out: Path, processor=None) -> Path:
    """Write an HF directory the way users have them: weights, config, tokenizer, processor."""
    hf_model.save_pretrained(str(out), safe_serialization=True)
    (processor or tokenizer).save_pretrained(str(out))
    return out


def load_omni(model_dir: Path, **model_cfg) -> BuiltModel:
    return build_model(ModelConfig(pretrained=str(model_dir), **model_cfg))


def processor_for(built: BuiltModel, max_seq_len: int = 4096) -> SampleProcessor:
    return SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                           item_processors=built.item_processors,
                           markers={"vision": "<image>", "audio": "<audio>"},
                           max_seq_len=max_seq_len)


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
                                hf_inputs: Callable[[Sample], dict], rtol=1e-5, atol=1e-6) -> None:
    """Same mean token loss and the same gradient on every parameter (mapped by HF key)."""
    total = sum(s.num_targets for s in samples)
    reference.zero_grad()
    ref_loss = 0.0
    for s in samples:
        logits = reference(**hf_inputs(s)).logits[0]
        ref_loss = ref_loss + F.cross_entropy(logits.float(), sample_targets(s), reduction="sum",
                                              ignore_index=IGNORE_INDEX)
    (ref_loss / total).backward()
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}

    model = built.model
    model.zero_grad()
    out = model(pack(samples, built.item_processors))
    (out.loss_sum / out.num_targets).backward()
    torch.testing.assert_close(out.loss_sum / out.num_targets, ref_loss / total, rtol=1e-6, atol=1e-6)
    ours = dict(model.named_parameters())
    key_map = model.hf_key_map()
    checked = 0
    for hf_key, grad in ref_grads.items():
        ours_grad = ours[key_map[hf_key]].grad
        if grad is None:
            assert ours_grad is None or not ours_grad.any(), hf_key
            continue
        torch.testing.assert_close(ours_grad, grad, rtol=rtol, atol=atol, msg=lambda m: f"{hf_key}: {m}")
        checked += 1
    assert checked > 0


def assert_round_trip(built: BuiltModel, out_dir: Path, reference) -> None:
    """Export -> same keys, bitwise-equal tensors as the HF model the OmniModel came from."""
    from ds_omni.model.convert import export_hf
    export_hf(built.model, out_dir, built.tokenizer, model_dir=built.model_dir)
    exported = type(reference).from_pretrained(str(out_dir))
    ref_state, exp_state = reference.state_dict(), exported.state_dict()
    assert ref_state.keys() == exp_state.keys()
    for key in ref_state:
        assert torch.equal(ref_state[key], exp_state[key]), key
