"""LLaVA: OmniModel parity with HF (logits, loss, gradients), exact round trip, bad input."""

import pytest
import torch

from ds_omni.data.demo import shapes_rows
from ds_omni.errors import ModelError
from tests.family_checks import (assert_logits_match, assert_loss_and_grads_match,
                                 assert_round_trip, load_omni, processor_for)
from tests.family_dirs import make_llava_dir


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_llava_dir(tmp_path_factory.mktemp("llava"))

@pytest.fixture(scope="module")
def built(llava_dir):
    return load_omni(llava_dir)


@pytest.fixture(scope="module")
def reference(llava_dir):
    from transformers import LlavaForConditionalGeneration
    return LlavaForConditionalGeneration.from_pretrained(str(llava_dir))


def _samples(built):
    import io
    from PIL import Image
    proc = processor_for(built)
    rows = shapes_rows(3, seed=5)
    img = [Image.open(io.BytesIO(r["image"]["bytes"])) for r in rows]
    two = [{"from": "human", "value": "<image> or <image>?"}, {"from": "gpt", "value": "the first"}]
    return [
        proc(text=rows[0]["conversations"], media={"vision": [img[0]]}, sample_id="one", source="t"),
        proc(text="a caption with no image at all", media={}, sample_id="text", source="t"),
        proc(text=two, media={"vision": [img[1], img[2]]}, sample_id="two", source="t"),
    ]


def _hf_inputs(sample):
    pix = [item.inputs["pixel_values"] for _, item in sample.items]
    extra = {"pixel_values": torch.stack(pix)} if pix else {}
    return {"input_ids": sample.input_ids[None], **extra}


def test_logits_match_hf(built, reference):
    assert_logits_match(built, reference, _samples(built), _hf_inputs)


def test_loss_and_gradients_match_hf(built, reference):
    assert_loss_and_grads_match(built, reference, _samples(built), _hf_inputs)


def test_placeholder_count_matches_the_hf_processor(built, llava_dir):
    from transformers import AutoProcessor
    from PIL import Image
    hf_proc = AutoProcessor.from_pretrained(str(llava_dir))
    image = Image.new("RGB", (32, 32))
    ids = hf_proc(images=[image], text="<image>", return_tensors="pt")["input_ids"][0]
    image_id = built.item_processors["vision"].placeholder_id
    assert int((ids == image_id).sum()) == built.item_processors["vision"].process(image).num_embeddings


def test_export_round_trip_is_exact(built, reference, tmp_path):
    assert_round_trip(built, tmp_path / "export", reference)


def test_mismatched_placeholders_are_a_clear_error(built):
    from ds_omni.data.packing import pack
    sample = _samples(built)[0]
    ids = sample.input_ids.clone()
    first = (ids == built.item_processors["vision"].placeholder_id).nonzero()[0]
    ids[first] = 7
    sample.input_ids = ids
    with pytest.raises(ModelError, match=r"produced 16 embeddings but the text has 15 'vision' "
                                         r"placeholder tokens"):
        built.model(pack([sample], built.item_processors))


def test_without_dummies_a_text_only_row_skips_the_encoder_and_a_zero_grad_stands_in(built):
    """`encoder_dummies` off (ZeRO-0/1, the pipeline): the same loss and, once the missing
    gradients are zero-filled, the same gradients as the zero-weight dummy pass, with the vision
    tower never run."""
    from ds_omni.data.packing import pack
    from ds_omni.parallelize import apply_plan
    from ds_omni.parallelize.pipeline import fill_missing_grads
    model, mb = built.model, pack([_samples(built)[1]], built.item_processors)
    runs = []
    hook = model.encoders["vision"].register_forward_hook(lambda *_: runs.append(1))
    losses, grads = [], []
    try:
        for dummies in (True, False):
            apply_plan(model, encoder_dummies=dummies)
            model.zero_grad(set_to_none=True)
            loss = model(mb).loss_sum
            loss.backward()
            fill_missing_grads(model.parameters())
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    finally:
        model.router = None  # the model as built again
        model.zero_grad(set_to_none=True)
        hook.remove()
    assert runs == [1] and torch.equal(losses[0], losses[1])  # the dummy ran once, with dummies
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name
    vision = [n for n in grads[1] if n.startswith("encoders.vision.")]
    assert vision and not any(grads[1][n].any() for n in vision)


def test_freezing_parts(llava_dir):
    built = load_omni(llava_dir, freeze=["vision", "llm"])
    model = built.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("encoders.vision.projector.") for n in trainable)
    from ds_omni.data.packing import pack
    out = model(pack(_samples(built)[:1], built.item_processors))
    out.loss_sum.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    with pytest.raises(ModelError, match="has no audio part"):
        load_omni(llava_dir, freeze=["audio"])


def test_cli_round_trip_hf_to_omni_to_hf(llava_dir, reference, tmp_path):
    from ds_omni.cli import main
    assert main(["convert", "--hf", str(llava_dir), "--out", str(tmp_path / "omni")]) == 0
    from safetensors.torch import load_file
    keys = load_file(str(tmp_path / "omni" / "omni.safetensors")).keys()
    assert any(k.startswith("backbone.layers.1.") for k in keys)
    assert any(k.startswith("encoders.vision.projector.") for k in keys)
    assert main(["convert", "--omni", str(tmp_path / "omni"), "--out", str(tmp_path / "hf")]) == 0
    back = type(reference).from_pretrained(str(tmp_path / "hf")).state_dict()
    ref = reference.state_dict()
    assert back.keys() == ref.keys()
    assert all(torch.equal(back[k], ref[k]) for k in ref)


def test_bad_model_directories(llava_dir, tmp_path):
    import json
    import shutil
    from ds_omni.model.build import load
    with pytest.raises(ModelError, match="is not an HF model directory: no config.json"):
        load(tmp_path)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "blip_2"}))
    with pytest.raises(ModelError, match="unknown model family: model_type 'blip_2'"):
        load(odd)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(llava_dir, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelError, match="no safetensors weights in"):
        load(no_weights)
    other = tmp_path / "other_config"
    shutil.copytree(llava_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] = 96
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="do not fit its config.json"):
        load(other)
