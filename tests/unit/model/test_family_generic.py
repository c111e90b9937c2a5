"""The generic family adapter and the coverage sweep over transformers' image-text-to-text mapping.

The sweep (`ds_omni.coverage.sweep`, also `ds-omni families`) builds a tiny random model of every
family it has a recipe for, loads it through `build_model`, and compares a packed row (images at
the start, middle and end of a prompt, a text-only sample) with HF's own forward on HF's processor
output: logits, loss (its mask found in the rendered text) and every gradient; plus a bitwise export
round trip. This test runs that sweep once and holds it to the families named in issue 12 and to the
docs/models.md's table.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from ds_omni.coverage import sweep, torchvision_rows
from ds_omni.errors import ModelError
from ds_omni.model.families import family_for, generic, hf_processor

MODELS_DOC = Path(__file__).resolve().parents[3] / "docs" / "models.md"
MUST_PASS = ("qwen2_vl", "qwen2_5_vl", "internvl", "llava_onevision", "idefics3", "smolvlm",
             "llava", "llava_next", "qwen2_5_omni_thinker", "qwen3_vl", "gemma3", "mistral3")
# paligemma left the list when the sweep began to compare HF's tokens of whole samples:
# `recipes.common.NOT_EXACT` says why


@pytest.fixture(scope="module")
def results():
    return sweep.sweep()


def test_sweep_covers_the_mapping_and_every_recipe_is_exact(results):
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    assert list(results) == list(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    checked = set(sweep.RECIPES) - set(sweep.NOT_EXACT)
    failed = {t: results[t].reason for t in checked if not results[t].supported}
    assert not failed, failed
    assert all(results[t].supported for t in MUST_PASS)
    assert all(r.reason for r in results.values())
    # only a family checked by a recipe counts as supported
    assert {t for t, r in results.items() if r.supported} == checked


def test_models_doc_table_is_the_sweep(results):
    """docs/models.md's coverage table lists every model type with the sweep's verdict."""
    rows = dict(re.findall(r"^\| `([\w.-]+)` \| (yes|no) \|", MODELS_DOC.read_text(), re.M))
    assert rows == {t: "yes" if r.supported else "no" for t, r in results.items()}


def test_known_gaps_have_their_reasons(results):
    assert results["granite_docling"].supported  # its multipliers: ds_omni.model.outside
    assert "PLE" in sweep.static_problem("gemma4")  # its default; the recipe has none
    assert results["granite4_vision"].supported  # its layer map: ds_omni.model.deepstack
    assert "token_type_ids" in results["gemma3n"].reason
    assert "get_image_features" in results["mllama"].reason
    assert results["ovis2"].supported  # its indicator tokens: generic.indicator_ids
    if not torchvision_rows.importable_here():  # checked in the sweep's torchvision child
        assert "image processor run with torchvision's Python" in results["lfm2_vl"].reason
        assert "video processor (its processor reads" in results["minicpmv4_6"].reason
    assert "hyper-connections" in results["hy_v4_vl"].reason
    assert "block states" in results["inkling2"].reason


def test_processor_named_by_the_model_file():
    """GLM-OCR and Cosmos3-Omni take the processor their model file's example loads (GLM-4.1V's,
    Qwen3-VL's; `hf_processor.PROCESSOR_OF`); a type whose file names none stays without one."""
    assert hf_processor.processor_class("glm_ocr").__name__ == "Glm4vProcessor"
    assert hf_processor.processor_class("cosmos3_omni").__name__ == "Qwen3VLProcessor"
    assert sweep.processor_problem("glm_ocr") is None
    assert "maps no processor" in sweep.processor_problem("kosmos-2")


def test_pixtral_processor_needs_no_torchvision():
    """Mistral3's processor (HF's Pixtral one, which imports torchvision for one size function)
    comes with the PIL image processor standing in, and the stand-in is not left behind."""
    import sys
    cls = hf_processor.processor_class("mistral3")
    assert cls.__name__ == "PixtralProcessor"
    assert cls.get_attributes() == ["image_processor", "tokenizer"]
    fast = sys.modules.get("transformers.models.pixtral.image_processing_pixtral")
    assert fast is None or "_pil_" not in fast.__name__


def test_planted_error_is_seen(tmp_path, monkeypatch):
    """The parity check can fail: 1-D positions for Qwen2.5-VL (what HF silently does without
    its rope index) move the logits past the tolerance."""
    # on the class that serves qwen2_5_vl (the dedicated qwen2_vl file since video landed)
    monkeypatch.setattr(type(family_for("qwen2_5_vl")), "position_ids",
                        lambda self, ids, items: torch.arange(ids.shape[0]).expand(3, -1))
    result = sweep.check_family("qwen2_5_vl", sweep.RECIPES["qwen2_5_vl"], tmp_path)
    assert not result.supported and "logits differ" in result.reason


def test_zero_matrices_are_filled_before_the_check():
    """HF starts Gemma 3's projector at zeros: every image embedding is then zero, so the logits
    cannot see the images (and fp32 rounding, through RMSNorm of zero vectors, moved the
    projector's gradient by 0.03: the gap the sweep once reported). The sweep fills such matrices;
    vectors (here its norms' zero weights) keep HF's values."""
    torch.manual_seed(0)
    config, _ = sweep.RECIPES["gemma3"]()
    hf = family_for("gemma3").build_hf(config)
    pixels = torch.randn(2, 3, 32, 32)
    assert not hf.model.get_image_features(pixels).pooler_output.any()
    filled = sweep.unzero_matrices(hf)
    assert filled == ["model.multi_modal_projector.mm_input_projection_weight"]
    rows = hf.model.get_image_features(pixels).pooler_output  # [2 images, 4 tokens, D]
    assert rows.abs().amax(-1).gt(0).all() and not torch.equal(rows[0], rows[1])
    assert not hf.model.multi_modal_projector.mm_soft_emb_norm.weight.any()


def test_planted_image_swap_is_seen(tmp_path, monkeypatch):
    """With Gemma 3's projector filled, the sweep's logits see each image: a sample's two
    images swapped on HF's side (Gemma 3's processor resizes both alike, so the token ids still
    agree) moves them past the tolerance."""
    sweep_samples = sweep.sweep_samples

    def swapped(built):
        samples, cases = sweep_samples(built)
        return samples, {k: (turns, imgs[::-1]) for k, (turns, imgs) in cases.items()}
    monkeypatch.setattr(sweep, "sweep_samples", swapped)
    result = sweep.check_family("gemma3", sweep.RECIPES["gemma3"], tmp_path)
    assert not result.supported and "logits differ" in result.reason, result.reason


def test_text_only_row_runs_the_dummy_image(tmp_path):
    """A micro-batch without images still runs the tower (ZeRO-3 gathers the same parameters on
    every rank) and changes no number; gradients reach every generic-encoder parameter."""
    from ds_omni.config import ModelConfig
    from ds_omni.data.packing import pack
    from ds_omni.data.processing import SampleProcessor
    from ds_omni.model.build import build_model
    config, processor = sweep.RECIPES["llava_onevision"]()
    hf = family_for("llava_onevision").build_hf(config)
    hf.save_pretrained(str(tmp_path))
    sweep.save_processor_parts(processor, tmp_path)
    built = build_model(ModelConfig(pretrained=str(tmp_path)))
    proc = SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                           item_processors=built.item_processors, markers={"vision": "<image>"},
                           max_seq_len=256)
    sample = proc(text="just words here", media={}, sample_id="t", source="s")
    mb = pack([sample], built.item_processors)
    with torch.no_grad():
        ours = built.model.logits(mb)[0]
        ref = hf.eval()(input_ids=sample.input_ids[None]).logits[0]
    assert (ours - ref).abs().max() <= sweep.LOGITS_ATOL
    out = built.model(mb)
    out.loss_sum.backward()
    encoder = built.model.encoders["vision"]
    reached = {n: p.grad for n, p in encoder.named_parameters() if p.grad is not None}
    assert any("patch_embedding" in n for n in reached), sorted(reached)  # the tower ran
    assert all(not g.any() for g in reached.values())  # and counted zero
    img = sweep.images()[1]
    out = built.model(pack([proc(text="<image> a shape", media={"vision": [img]}, sample_id="i",
                                 source="s")], built.item_processors))
    built.model.zero_grad()
    out.loss_sum.backward()
    assert encoder.projector.params["image_newline"].grad.abs().sum() > 0


def test_family_without_image_hooks_is_a_clear_error():
    with pytest.raises(ModelError, match=r"(?s)MllamaModel has no get_image_features.*[Cc]ompose"
                                         r".*ds_omni/model/families"):
        family_for("mllama")


def test_inner_model_named_otherwise_is_found_through_automodel():
    """MiniMax-M3's conditional-generation class holds a MiniMaxM3VLModel (AutoModel's base class
    for its type), not a MiniMaxM3SparseModel; Llama 4's AutoModel class is itself, no inner one."""
    from ds_omni.model.families.generic import inner_class
    from ds_omni.model.families.hf_processor import hf_class_of
    assert inner_class(hf_class_of("minimax_m3_vl"), "minimax_m3_vl").__name__ == "MiniMaxM3VLModel"
    assert inner_class(hf_class_of("minimax_m3_vl")) is None
    assert inner_class(hf_class_of("llama4"), "llama4") is None


def test_family_with_an_unknown_token_type_mask_is_refused():
    with pytest.raises(ModelError, match="token_type_ids.*Gemma 3's image blocks"):
        family_for("gemma3n")


def test_family_that_adds_features_into_one_image_block_is_refused():
    """Molmo 2's forward adds the image features onto the placeholder embeddings and lets every
    image token of a sample see every other (one block across images): the generic adapter,
    which replaces embeddings and opens contiguous spans only, refuses it rather than train it
    with other numbers."""
    with pytest.raises(ModelError, match=r"(?s)adds the image features.*one bidirectional block"):
        family_for("molmo2")


def test_fuyu_image_processor_is_its_torchvision_one(tmp_path, monkeypatch):
    """Fuyu's PIL image processor fails on every image (`hf_processor.BROKEN_PIL`: drop the entry
    once this test sees it work); without torchvision, loading says so instead of failing there. Its
    processor writes the image token itself: an image is written as "", and the
    beginning-of-answer token it appends is not the image's."""
    import transformers.utils
    from PIL import Image
    from transformers.models.fuyu.image_processing_pil_fuyu import FuyuImageProcessorPil
    from transformers.models.fuyu.processing_fuyu import FuyuProcessor
    from ds_omni.coverage.recipes import demo_tokenizer
    pil = FuyuImageProcessorPil(size={"height": 32, "width": 32},
                                patch_size={"height": 8, "width": 8})
    with pytest.raises(TypeError, match="transpose"):
        FuyuProcessor(image_processor=pil, tokenizer=demo_tokenizer(
            ["|SPEAKER|", "|NEWLINE|"]))(text=[""], images=[Image.new("RGB", (32, 32))])
    monkeypatch.setattr(transformers.utils, "is_torchvision_available", lambda: False)
    with pytest.raises(ModelError, match="FuyuImageProcessorPil.*broken.*torchvision"):
        hf_processor._pil_image_processor("fuyu", tmp_path)
    config = sweep.config_for("fuyu")
    assert hf_processor.appended_text(config) == "<0x04>"
    assert hf_processor.processor_marker(None, config) == ""


def test_cli_families_json(capsys):
    from ds_omni.cli import main
    assert main(["families", "--json", "gemma3n", "mllama"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"gemma3n", "mllama"}
    assert out["gemma3n"]["supported"] is False and "token_type_ids" in out["gemma3n"]["reason"]


@pytest.mark.parametrize("sp", [2, 3])
def test_sequence_shards_carry_generic_items(tmp_path, sp):
    """Under SP the generic items (per-image inputs, HF's 3-D positions) are cut and collated per
    shard like a dedicated family's: the shards rebuild the row, every item is encoded by one shard
    and every placeholder is received where it sits, also for an image cut by a shard boundary."""
    from ds_omni.data.processing import SampleProcessor
    from tests.unit.parallel.test_reshard import _samples, assert_shards_rebuild_the_row
    config, processor = sweep.RECIPES["qwen2_5_vl"]()
    sweep.save_processor_parts(processor, tmp_path)
    family = family_for("qwen2_5_vl")
    processors = family.item_processors(config, tmp_path, tokenizer=processor.tokenizer)
    proc = SampleProcessor(tokenizer=processor.tokenizer, family=family,
                           item_processors=processors, markers={"vision": "<image>"},
                           max_seq_len=4096)
    samples = _samples(proc, [(32, 32), (84, 56), (40, 24)])
    assert samples[0].position_ids.shape[0] == 3  # M-RoPE from HF's get_rope_index
    cut = sum(assert_shards_rebuild_the_row(samples[:n], processors, sp) for n in (1, 2, 3, 4))
    assert cut > 0, "some image should sit across a shard boundary"


@pytest.mark.parametrize("model_type", ["gemma3", "paligemma"])
def test_bidirectional_blocks_ride_along_packing_and_shards(tmp_path, model_type):
    """Gemma 3's blocks are its images' token runs, PaliGemma's the prompt before the first
    trained token; packed, they move to row positions, and every SP shard carries the whole
    row's blocks (Ulysses' kernel sees the whole row), also past a padded end."""
    from ds_omni.data.packing import SeqShard, pack
    from ds_omni.data.processing import SampleProcessor
    from tests.unit.parallel.test_reshard import _cost, _samples
    config, processor = sweep.RECIPES[model_type]()
    sweep.save_processor_parts(processor, tmp_path)
    family = family_for(model_type)
    processors = family.item_processors(config, tmp_path, tokenizer=processor.tokenizer)
    proc = SampleProcessor(tokenizer=processor.tokenizer, family=family,
                           item_processors=processors, markers={"vision": "<image>"},
                           max_seq_len=4096)
    samples = _samples(proc, [(32, 32), (84, 56), (40, 24)])
    image = generic.image_token_id(config)
    for s in samples:
        if model_type == "gemma3":
            runs = s.input_ids == image
            assert sum(b - a for a, b in s.blocks) == int(runs.sum()) and all(
                bool(runs[a:b].all()) for a, b in s.blocks)
        else:
            first = int(s.loss_mask.nonzero()[0])
            assert s.blocks == ([(0, first)] if first > 1 else [])  # one token: causal anyway
            assert bool((s.input_ids[:first] == image).any()) == (s.sample_id != "b")
    whole = pack(samples, processors)
    offsets = whole.cu_seqlens.tolist()
    expect = [(o + a, o + b) for s, o in zip(samples, offsets) for a, b in s.blocks]
    assert whole.blocks.tolist() == [list(x) for x in expect]
    for sp in (2, 3):
        for r in range(sp):
            assert torch.equal(pack(samples, processors, SeqShard(r, sp, _cost)).blocks,
                               whole.blocks)


def test_ernie_layers_get_the_processors_moe_token_types():
    """ERNIE-4.5-VL's MoE layers route by moe_mm_token_type_ids: the family derives them from the
    token ids as HF's processor does (start / end tokens count as the image's), the backbone
    hands them to every layer (without them its sweep logits differ by 9e-3), and the pipeline,
    whose stages do not carry them, refuses the model with the fix."""
    from ds_omni.parallelize.pipeline import pipeline_layers
    config, processor = sweep.RECIPES["ernie4_5_vl_moe"]()
    family = family_for("ernie4_5_vl_moe")
    model = family.to_omni(family.build_hf(config))
    tok = processor.tokenizer
    ids = torch.tensor([[5, tok.image_start_token_id, tok.image_token_id, tok.image_token_id,
                         tok.image_end_token_id, 7, tok.video_start_token_id, tok.video_token_id,
                         tok.video_end_token_id, 9]])
    want = torch.tensor(processor.create_moe_mm_token_type_ids(ids.tolist()))
    assert torch.equal(family.layer_inputs(ids)["moe_mm_token_type_ids"], want)
    assert want.tolist() == [[0, 1, 1, 1, 1, 0, 2, 2, 2, 0]]
    assert family_for("qwen2_vl").layer_inputs(ids) == {}
    with pytest.raises(ModelError, match="moe_mm_token_type_ids.*parallel.pp to 1"):
        pipeline_layers(model, None)


@pytest.mark.parametrize("one, two, want", [
    # Chameleon: <boi> I <eoi> probe <sep>; the separator follows the sample's text
    ([1, 9, 2, 7, 5], [1, 9, 2, 1, 9, 2, 7, 5], ([5], 0)),
    # Idefics2: <fake> I <fake> probe; adjacent images share one closing <fake>
    ([3, 9, 3, 7], [3, 9, 3, 9, 3, 7], ([], 1)),
    # PaliGemma: I <bos> probe \n; its images come first, then one <bos>
    ([9, 9, 0, 7, 4], [9, 9, 9, 9, 0, 7, 4], ([4], 1)),
    # an image whose tokens depend on the other images of the call: no layout is assumed
    ([9, 8, 7], [9, 8, 6, 8, 7], None),
])
def test_layout_probe_finds_suffix_and_shared_tail(one, two, want):
    """`probe_layout` reads what HF's processor writes around images from a one-image and a
    two-image call (each followed by the probe text, id 7)."""
    from ds_omni.model.families.hf_processor import probe_layout
    assert probe_layout(one, two, [7], lambda ids: ids) == want


def test_numbered_images_and_shared_tails_reach_the_sample():
    """`SampleProcessor` numbers a sample's images through `tokens_at` (MiniCPM-V's image ids)
    and writes the tail adjacent images share once, not after each (Idefics2's <fake>)."""
    from ds_omni.data.processing import SampleProcessor
    from ds_omni.batch import EncodedItem, ItemProcessor
    from ds_omni.model.family import Family

    class Numbered(ItemProcessor):
        placeholder_id, shared_tail = 9, 1

        def process(self, item):
            return EncodedItem(inputs={"x": torch.zeros(1)}, num_embeddings=1)

        def tokens_at(self, item, index):
            return [100 + index, 9, 300]  # an image number, its token, a closing tail

    from tests.family_dirs import demo_tokenizer
    tok = demo_tokenizer()
    proc = SampleProcessor(tokenizer=tok, family=Family(), item_processors={"vision": Numbered()},
                           markers={"vision": "<image>"}, max_seq_len=64)
    s = proc(text="<image><image> a <image>", media={"vision": [0, 1, 2]}, sample_id="s",
             source="t")
    ids = s.input_ids.tolist()
    start = 1 if ids[:1] == [tok.bos_token_id] else 0
    assert ids[start:start + 5] == [100, 9, 101, 9, 300]  # one tail after the adjacent pair
    at = ids.index(102)
    assert ids[at:at + 3] == [102, 9, 300] and ids.count(300) == 2


def test_a_processor_that_refuses_the_layout_probe_keeps_one_image_tokens(caplog):
    """A processor that takes one image a text fails the two-image probe: loading goes on, each
    image keeping the tokens written for it alone (no suffix cut, no shared tail), and says so."""
    from ds_omni.model.families.hf_processor import GenericItemProcessor

    class OneImage:
        tokenizer = staticmethod(lambda text, add_special_tokens=False: {"input_ids": [7]})

        def __call__(self, text, images, return_tensors=None):
            if len(images) > 1:
                raise ValueError("one image per text")
            return {"input_ids": torch.tensor([[9, 9, 7, 5]])}

    with caplog.at_level("WARNING"):
        proc = GenericItemProcessor(OneImage(), "<image>", placeholder_id=9, bos_id=None)
    assert proc.shared_tail == 0 and proc.appended == []
    assert "did not take the layout probe" in caplog.text
