"""LoRA (model.lora) against peft on one process: the same adapted layers, loss and gradients as
peft's own `get_peft_model` on the HF model (fp32); exports that plain transformers (merged) and
`PeftModel.from_pretrained` (adapter) load to the same logits; bad target names.
(tests/dist/test_checkpoint_export.py trains it under ZeRO 2 and 3, resumes and exports.)"""

import pytest
import torch
import torch.nn.functional as F

from ds_omni.batch import IGNORE_INDEX
from ds_omni.config import LoraConfig, ModelConfig
from ds_omni.data.packing import pack, sample_targets
from ds_omni.errors import ModelError
from ds_omni.model.build import build_model
from tests.family_dirs import make_llava_dir
from tests.unit.model.test_family_llava import _hf_inputs, _samples

LORA = dict(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "mlp.down_proj"],
            parts=["llm"], trainable=["projector"])
# the same layers, found by peft's own (regex) matching on the HF model's names
PEFT_TARGETS = r".*language_model\.layers\.\d+\.(self_attn\.(q_proj|v_proj)|mlp\.down_proj)"
PEFT_PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_llava_dir(tmp_path_factory.mktemp("llava"))


def _built(llava_dir, **lora):
    built = build_model(ModelConfig(pretrained=str(llava_dir), lora=LoraConfig(**{**LORA, **lora})))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B starts at zero (the adapter is a no-op): make it count
        for name, p in built.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return built


@pytest.fixture(scope="module")
def built(llava_dir):
    return _built(llava_dir)


@pytest.fixture(scope="module")
def reference(llava_dir, built):
    """peft on the HF model, the adapters' weights copied from ds_omni's by HF name."""
    import peft
    from transformers import LlavaForConditionalGeneration
    hf = LlavaForConditionalGeneration.from_pretrained(str(llava_dir))
    ref = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=PEFT_TARGETS))
    ref.base_model.model.model.multi_modal_projector.requires_grad_(True)
    ours = built.model.hf_model.state_dict()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_" in name:
                p.copy_(ours[name.removeprefix(PEFT_PREFIX)])
    return ref


def test_the_same_layers_train_as_under_peft(built, reference):
    ours = {n for n, p in built.model.hf_model.named_parameters() if p.requires_grad}
    theirs = {n.removeprefix(PEFT_PREFIX) for n, p in reference.named_parameters() if p.requires_grad}
    assert ours == theirs
    assert sum("lora_A" in n for n in ours) == 3 * 2  # 3 layers x 2 decoder layers
    assert any("multi_modal_projector" in n for n in ours)


def test_loss_and_adapter_gradients_equal_peft(built, reference):
    samples = _samples(built)
    total = sum(s.num_targets for s in samples)
    reference.zero_grad()
    ref_loss = sum(F.cross_entropy(reference(**_hf_inputs(s)).logits[0].float(), sample_targets(s),
                                   reduction="sum", ignore_index=IGNORE_INDEX) for s in samples)
    (ref_loss / total).backward()
    model = built.model
    model.zero_grad()
    out = model(pack(samples, built.item_processors))
    (out.loss_sum / total).backward()
    torch.testing.assert_close(out.loss_sum / total, ref_loss / total, rtol=1e-6, atol=1e-6)
    ours = dict(model.hf_model.named_parameters())
    checked = 0
    for name, p in reference.named_parameters():
        if p.requires_grad:
            key = name.removeprefix(PEFT_PREFIX)
            torch.testing.assert_close(ours[key].grad, p.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{key}: {m}")
            checked += "lora_A" in key and bool(p.grad.abs().sum() > 0)
    assert checked == 6
    assert all(p.grad is None for n, p in ours.items() if "lora_" not in n and "projector" not in n)


@pytest.mark.parametrize("export", ["merged", "adapter"])
def test_export_loads_with_transformers_or_peft_to_the_same_logits(built, tmp_path, export,
                                                                  monkeypatch):
    import peft
    from transformers import LlavaForConditionalGeneration
    from ds_omni.model.convert import export_hf
    from tests.family_checks import omni_logits
    monkeypatch.setitem(built.model.lora_meta, "export", export)  # what model.lora.export sets
    export_hf(built.model, tmp_path, built.tokenizer, model_dir=built.model_dir)
    loaded = LlavaForConditionalGeneration.from_pretrained(str(tmp_path))
    assert not any("lora" in k for k in loaded.state_dict())
    if export == "adapter":
        loaded = peft.PeftModel.from_pretrained(loaded, str(tmp_path / "adapter"))
    samples = _samples(built)
    with torch.no_grad():
        _, ours = omni_logits(built, samples)
        for sample, want in zip(samples, ours):
            got = loaded(**_hf_inputs(sample)).logits[0]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert any(p.requires_grad for n, p in built.model.named_parameters() if "lora_" in n)


def test_target_modules_that_match_nothing_name_the_layers_that_exist(llava_dir):
    with pytest.raises(ModelError, match=r"'qkv' matches no linear layer of the parts \['llm'\]"
                                         r".*'down_proj'.*'q_proj'"):
        build_model(ModelConfig(pretrained=str(llava_dir), lora=LoraConfig(target_modules=["qkv"])))


@pytest.mark.parametrize("lora, match", [
    ({"parts": ["llm", "eyes"]}, r"lora.parts: unknown part\(s\) \['eyes'\]"),
    ({"trainable": ["llm"]}, r"\['llm'\] in both parts"),
    ({"rank": 0}, "need rank >= 1"),
    ({"target_modules": []}, "must not be empty")])
def test_bad_lora_settings_name_the_field(lora, match):
    from ds_omni.config import from_dict
    from ds_omni.errors import ConfigError
    with pytest.raises(ConfigError, match=match):
        from_dict(LoraConfig, lora, "model.lora")


def test_freeze_with_lora_is_an_error():
    from ds_omni.errors import ConfigError
    with pytest.raises(ConfigError, match="remove model.freeze"):
        ModelConfig(pretrained="x", freeze=["vision"], lora=LoraConfig())
