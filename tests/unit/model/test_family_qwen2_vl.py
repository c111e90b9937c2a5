"""Qwen2-VL: OmniModel parity with HF (logits, loss, gradients, M-RoPE positions), dynamic
resolution in one micro-batch, exact round trip, the exported processor."""

import io
import json
from unittest import mock

import pytest
import torch

from ds_omni.data.demo import ensure_builtin, shapes_rows
from ds_omni.data.processing import SampleProcessor
from ds_omni.errors import ModelError
from tests.family_checks import (VIDEO_MARKERS, assert_logits_match, assert_loss_and_grads_match,
                                 assert_round_trip, load_omni, processor_for)
from tests.family_dirs import (MERGE, QWEN_TOKENS, make_qwen2_vl_dir)

def hf_processor(model_dir):
    """HF's Qwen2VLProcessor for `model_dir` (its saved image processor and tokenizer).

    HF's constructor insists on a video processor and HF's video processors need torchvision, which
    ds_omni does not depend on; images need none, so only the constructor's class check is skipped.
    Image processing, placeholder expansion and mm_token_type_ids are HF's own code.
    """
    from transformers import AutoTokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin
    images = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None):
        return Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=None)


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return make_qwen2_vl_dir(tmp_path_factory.mktemp("qwen2_vl"))

@pytest.fixture(scope="module")
def built(qwen2_vl_dir):
    return load_omni(qwen2_vl_dir)


@pytest.fixture(scope="module")
def reference(qwen2_vl_dir):
    from transformers import Qwen2VLForConditionalGeneration
    return Qwen2VLForConditionalGeneration.from_pretrained(str(qwen2_vl_dir))


def _images():
    """Shapes pictures at three resolutions: 32x32 (as made), 84 wide x 56 high, 40 x 24."""
    from PIL import Image
    rows = shapes_rows(3, seed=5)
    img = [Image.open(io.BytesIO(r["image"]["bytes"])).convert("RGB") for r in rows]
    return rows, [img[0], img[1].resize((84, 56)), img[2].resize((40, 24))]


def _samples(built):
    """(samples, images of each sample): one image, text only, two images of different sizes."""
    proc = processor_for(built)
    rows, img = _images()
    two = [{"from": "human", "value": "<image><image>\nWhich one is larger?"},
           {"from": "gpt", "value": "the first"}]
    media = {"one": [img[0]], "text": [], "two": [img[1], img[2]]}
    texts = {"one": rows[0]["conversations"], "text": "a caption with no image at all", "two": two}
    samples = [proc(text=texts[k], media={"vision": media[k]} if media[k] else {}, sample_id=k,
                    source="t") for k in ("one", "text", "two")]
    return samples, media


def _hf_inputs(hf_proc, media):
    """What the HF processor gives the model for a sample: its tokens, the processor's pixels and
    grids of its images, and the processor's mm_token_type_ids (without them HF falls back to 1-D
    positions)."""
    def inputs(sample):
        ids = sample.input_ids[None]
        out = {"input_ids": ids,
               "mm_token_type_ids": torch.tensor(hf_proc.create_mm_token_type_ids(ids))}
        if media[sample.sample_id]:
            pix = hf_proc.image_processor(images=media[sample.sample_id], return_tensors="pt")
            out.update(pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"])
        return out
    return inputs


def test_logits_match_hf_with_mixed_resolutions(built, reference, qwen2_vl_dir):
    samples, media = _samples(built)
    grids = [tuple(item.meta["grid_thw"]) for s in samples for _, item in s.items]
    assert len(set(grids)) == 3, grids  # three resolutions in one micro-batch
    assert_logits_match(built, reference, samples, _hf_inputs(hf_processor(qwen2_vl_dir), media))


def test_loss_and_gradients_match_hf(built, reference, qwen2_vl_dir):
    samples, media = _samples(built)
    assert_loss_and_grads_match(built, reference, samples,
                                _hf_inputs(hf_processor(qwen2_vl_dir), media))


def test_position_ids_match_hf_get_rope_index(built, reference, qwen2_vl_dir):
    samples, media = _samples(built)
    hf_inputs = _hf_inputs(hf_processor(qwen2_vl_dir), media)
    for sample in samples:
        inputs = hf_inputs(sample)
        expected, _ = reference.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"],
            image_grid_thw=inputs.get("image_grid_thw"))
        assert sample.position_ids.shape == (3, sample.length)
        assert torch.equal(sample.position_ids, expected[:, 0]), sample.sample_id
    # the packed micro-batch carries each sample's positions, restarting at each sample
    from ds_omni.data.packing import pack
    mb = pack(samples, built.item_processors)
    assert torch.equal(mb.position_ids[:, 0], torch.cat([s.position_ids for s in samples], dim=1))


def test_image_tokens_match_the_hf_processor(built, qwen2_vl_dir):
    hf_proc = hf_processor(qwen2_vl_dir)
    items = built.item_processors["vision"]
    wrapped = "<|vision_start|><|image_pad|><|vision_end|>"
    for image in _images()[1]:
        out = hf_proc(images=[image], text=[wrapped], return_tensors="pt")
        item = items.process(image)
        assert out["input_ids"][0].tolist() == items.tokens(item), image.size
        assert int((out["input_ids"] == items.placeholder_id).sum()) == item.num_embeddings
        assert torch.equal(out["pixel_values"], item.inputs["pixel_values"])
        assert out["image_grid_thw"][0].tolist() == list(item.meta["grid_thw"])


def test_every_hf_parameter_is_registered_once(built):
    model = built.model
    key_map = model.hf_key_map()
    assert set(key_map) == set(model.hf_model.state_dict())
    encoder = model.encoders["vision"]
    tower = set(map(id, encoder.tower.parameters()))
    projector = set(map(id, encoder.projector.parameters()))
    assert tower and projector and not tower & projector
    assert (sum(p.numel() for p in model.parameters())
            == sum(p.numel() for p in model.hf_model.parameters()))


def test_text_only_micro_batch_runs_the_encoder_on_a_dummy_image(built):
    from ds_omni.data.packing import pack
    samples, _ = _samples(built)
    model = built.model
    model.zero_grad()
    out = model(pack([samples[1]], built.item_processors))
    out.loss_sum.backward()
    grads = [p.grad for p in model.encoders["vision"].parameters()]
    assert all(g is not None and not g.any() for g in grads)  # ran (ZeRO-3 needs it), counted zero
    model.zero_grad()


def test_export_round_trip_is_exact(built, reference, tmp_path):
    assert_round_trip(built, tmp_path / "export", reference)


def test_exported_processor_is_a_qwen2_vl_processor(built, tmp_path):
    out = tmp_path / "export"
    from ds_omni.model.convert import export_hf
    export_hf(built.model, out, built.tokenizer, model_dir=built.model_dir)
    saved = json.loads((out / "processor_config.json").read_text())
    vc = built.hf_config.vision_config
    assert saved["processor_class"] == "Qwen2VLProcessor"
    video = saved["video_processor"]
    assert (video["patch_size"], video["temporal_patch_size"], video["merge_size"]) \
        == (vc.patch_size, vc.temporal_patch_size, vc.spatial_merge_size)
    hf_proc, items = hf_processor(out), built.item_processors["vision"]
    image = _images()[1][1]
    got = hf_proc(images=[image], text=["<|vision_start|><|image_pad|><|vision_end|>"],
                  return_tensors="pt")
    item = items.process(image)
    assert got["input_ids"][0].tolist() == items.tokens(item)
    assert torch.equal(got["pixel_values"], item.inputs["pixel_values"])
    # a checkpoint's export saves the processor again from the one saved with it: unchanged
    built.family.save_processor(tmp_path / "again", built.hf_config, built.tokenizer, out)
    assert json.loads((tmp_path / "again" / "processor_config.json").read_text()) == saved


def test_export_names_the_models_image_token_in_the_tokenizer(built, tmp_path):
    """A tokenizer whose image_token is another token gets the model's one in the export (in a
    copy: the caller's tokenizer is left alone)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ensure_builtin("builtin:shapes", "tokenizer")))
    tok.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    assert tok.image_token == "<image>"
    built.family.save_processor(tmp_path, built.hf_config, tok, built.model_dir)
    assert AutoTokenizer.from_pretrained(str(tmp_path)).image_token == "<|image_pad|>"
    assert tok.image_token == "<image>"


def test_placeholders_without_enough_image_tokens_are_a_clear_error(built):
    from ds_omni.model.families.qwen2_vl import mrope_position_ids
    image_id = built.item_processors["vision"].placeholder_id
    ids = torch.tensor([1, 2] + [image_id] * 3 + [5])
    with pytest.raises(ModelError, match="needs 4 consecutive image placeholder tokens"):
        mrope_position_ids(ids, [(1, 4, 4)], image_id, MERGE)
    with pytest.raises(ModelError, match="has no image"):
        mrope_position_ids(ids, [], image_id, MERGE)


def test_processor_config_that_does_not_fit_the_tower_is_a_clear_error(built, tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from ds_omni.model.families.qwen2_vl import qwen2_vl_image_processor
    Qwen2VLImageProcessorPil(patch_size=8, merge_size=MERGE).save_pretrained(str(tmp_path))
    with pytest.raises(ModelError, match="patch_size=8 but the vision config has 4"):
        qwen2_vl_image_processor(built.hf_config.vision_config, tmp_path)


def test_freezing_parts(qwen2_vl_dir):
    from ds_omni.data.packing import pack
    built = load_omni(qwen2_vl_dir, freeze=["vision", "llm"])
    model = built.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("encoders.vision.projector.") for n in trainable)
    model(pack(_samples(built)[0][:1], built.item_processors)).loss_sum.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)


def test_trained_on_its_chat_template_a_sample_is_the_exported_processors_prompt(built, tmp_path):
    """With Qwen2-VL's own template (system prompt, two images of different sizes), a sample has
    the ids HF's processor makes of `apply_chat_template`'s prompt on the exported directory, and
    the mask covers the answer and its end of turn."""
    import copy
    from ds_omni.data.processing import SampleProcessor
    from ds_omni.data.templates import carry_template, resolve_template
    from ds_omni.model.convert import export_hf
    from tests.chat_templates import QWEN2_VL
    tok = copy.deepcopy(built.tokenizer)
    tok.chat_template = QWEN2_VL
    template = resolve_template("auto", tok)
    carry_template(tok, template)
    export_hf(built.model, tmp_path, tok, model_dir=built.model_dir)
    _, img = _images()
    turns = [{"from": "system", "value": "Answer briefly."},
             {"from": "human", "value": "<image><image>\nWhich one is larger?"},
             {"from": "gpt", "value": "the first"}]
    sample = SampleProcessor(tokenizer=tok, family=built.family,
                             item_processors=built.item_processors, markers={"vision": "<image>"},
                             max_seq_len=4096, template=template)(
        text=turns, media={"vision": img[1:]}, sample_id="two", source="t")
    hf_proc = hf_processor(tmp_path)
    assert hf_proc.tokenizer.chat_template == QWEN2_VL
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": "\nWhich one is larger?"}]},
                {"role": "assistant", "content": "the first"}]
    prompt = hf_proc.tokenizer.apply_chat_template(messages, tokenize=False)
    out = hf_proc(text=[prompt], images=img[1:], return_tensors="pt")
    assert sample.input_ids.tolist() == out["input_ids"][0].tolist()
    assert tok.decode(sample.input_ids[sample.loss_mask]) == "the first<|im_end|>"


# ------------------------------------------------------------------------------------- video
@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """An mp4 of 12 frames at 4 fps (40x24), and an mkv of one frame (32x32; the container keeps
    no frame count, and one frame leaves the temporal patch to a repeated frame)."""
    from tests.data_files import write_video
    out = tmp_path_factory.mktemp("videos")
    return {"mp4": str(write_video(out / "a.mp4", 12, 40, 24, fps=4, seed=1)),
            "mkv": str(write_video(out / "b.mkv", 1, 32, 32, fps=2, seed=2, codec="ffv1"))}


def _video_samples(built, videos):
    """A video; a video then an image in one turn (the text's order, not the columns'); text
    only; the mkv. Images and videos share the vision encoder of one packed micro-batch."""
    proc = processor_for(built, markers=VIDEO_MARKERS)
    _, img = _images()
    turns = lambda q: [{"from": "human", "value": q}, {"from": "gpt", "value": "a square moves"}]
    rows = {"video": (turns("<video>\nWhat moves?"), {"video": [videos["mp4"]]}),
            "mixed": (turns("<video> and <image>: same shape?"),
                      {"vision": [img[1]], "video": [videos["mp4"]]}),
            "text": ("a caption with no video at all", {}),
            "short": (turns("<video>\nAnd here?"), {"video": [videos["mkv"]]})}
    samples = [proc(text=t, media=m, sample_id=k, source="t") for k, (t, m) in rows.items()]
    return samples, {k: m for k, (_, m) in rows.items()}


def _hf_video_inputs(hf_proc, media, samples):
    """HF's inputs of each sample: its image processor's pixels for images, ds_omni's patches for
    videos (HF's video processor needs torchvision; `test_video_patches_...` checks the layout),
    pixel_values_videos + video_grid_thw, and the processor's mm_token_type_ids (video = 2)."""
    videos = {s.sample_id: [it for _, it in s.items if it.meta["placeholder_id"] == hf_proc.video_token_id]
              for s in samples}

    def inputs(sample):
        out = _hf_inputs(hf_proc, {k: m.get("vision", []) for k, m in media.items()})(sample)
        if videos[sample.sample_id]:
            items = videos[sample.sample_id]
            out.update(pixel_values_videos=torch.cat([it.inputs["pixel_values"] for it in items]),
                       video_grid_thw=torch.stack([it.inputs["image_grid_thw"] for it in items]))
        return out
    return inputs


def test_video_logits_positions_loss_and_gradients_match_hf(built, reference, qwen2_vl_dir, videos):
    samples, media = _video_samples(built, videos)
    hf_proc = hf_processor(qwen2_vl_dir)
    assert hf_proc.video_token_id == built.hf_config.video_token_id
    grids = {s.sample_id: [it.meta["grid_thw"] for _, it in s.items] for s in samples}
    # 3 s at 2 fps: 6 frames -> 3 temporal patches of 6x10 (40x24 is within the saved 64..1024
    # pixels); one frame -> one temporal patch (the frame twice)
    assert grids["video"] == [(3, 6, 10)] and grids["short"] == [(1, 8, 8)], grids
    assert [enc for enc, _ in samples[1].items] == ["vision", "vision"]
    assert samples[1].items[0][1].meta["frames"] == 6  # the video comes first in the text
    inputs = _hf_video_inputs(hf_proc, media, samples)
    for sample in samples:
        hf = inputs(sample)
        expected, _ = reference.model.get_rope_index(
            hf["input_ids"], hf["mm_token_type_ids"], image_grid_thw=hf.get("image_grid_thw"),
            video_grid_thw=hf.get("video_grid_thw"))
        assert torch.equal(sample.position_ids, expected[:, 0]), sample.sample_id
    assert_logits_match(built, reference, samples, inputs)
    assert_loss_and_grads_match(built, reference, samples, inputs)


def test_videos_are_carried_to_the_sequence_shards_holding_their_placeholders(built, videos):
    """Under SP=2 each image and video of a packed row is encoded by one rank, and the exchange
    the reshard plans make (played here in one process) gives every shard exactly the rows the
    whole row's embedding has there."""
    from ds_omni.data.packing import SeqShard, pack
    samples, _ = _video_samples(built, videos)
    procs = built.item_processors
    encoder = built.model.encoders["vision"]
    with torch.no_grad():
        whole = built.model.embed(pack(samples, procs))[0]  # [T, D]
        shards = [pack(samples, procs, SeqShard(r, 2, lambda e, it: float(it.meta["patches"])))
                  for r in range(2)]
        sent = []  # per rank: its encoded rows, grouped by destination
        for mb in shards:
            rows = encoder(mb.encoder_inputs["vision"]) if mb.encoder_inputs else whole[:0]
            rows = rows[mb.route.reshard.send_order]
            sent.append(rows.split(mb.route.reshard.send_counts))
        assert all(mb.encoder_inputs for mb in shards)  # the items are split over both ranks
        for r, mb in enumerate(shards):
            got = built.model.backbone.embed_tokens(mb.input_ids)[0].clone()  # [S, D]
            got[mb.route.reshard.recv_positions] = torch.cat([sent[s][r] for s in range(2)])
            lo = r * got.shape[0]
            real = min(got.shape[0], whole.shape[0] - lo)
            torch.testing.assert_close(got[:real], whole[lo:lo + real], rtol=0, atol=1e-6)
    videos_rows = sum(int((mb.input_ids == built.hf_config.video_token_id).sum()) for mb in shards)
    assert videos_rows == sum(it.num_embeddings for s in samples for _, it in s.items
                              if it.meta["placeholder_id"] == built.hf_config.video_token_id)


def test_a_video_source_trains_through_the_loader(built, videos, tmp_path):
    """A jsonl source with a video column (paths relative to the file) through the real loader:
    its step carries every video, sampled as data.video says, the cost model counts their
    patches, and the tower gets gradients from them."""
    import shutil
    from types import SimpleNamespace
    from ds_omni.config import DataConfig, SchemaConfig, SourceConfig, VideoConfig
    from ds_omni.data.build import cost_model_for, sample_processors
    from ds_omni.data.loader import OmniLoader
    from ds_omni.data.rank_place import LoaderComms, RankPlace
    from ds_omni.data.sources import Source
    from ds_omni.parallel.groups import TorchDataComm
    shutil.copy(videos["mp4"], tmp_path / "clip.mp4")
    turns = [{"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "a dot"}]
    rows = [{"id": f"v{i}", "conversations": turns, "clip": "clip.mp4"} for i in range(3)]
    rows.append({"id": "t", "conversations": [turns[0] | {"value": "Hi"}, turns[1]], "clip": None})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(sources=[SourceConfig(name="v", path=str(tmp_path / "rows.jsonl"),
                                            schema=SchemaConfig(image=None, video="clip"))],
                      max_seq_len=256, chunk_rows=4, video=VideoConfig(num_frames=4))

    def step(scales=None):
        loader = OmniLoader([Source(s, data.chunk_rows) for s in data.sources],
                            sample_processors(SimpleNamespace(data=data), built),
                            cost_model_for(built, [], scales), data, global_batch_size=4,
                            place=RankPlace(num_micro=2),
                            comms=LoaderComms(TorchDataComm()))
        return loader.next_step()
    batch = step()
    video_id = built.hf_config.video_token_id
    per_video = 2 * 6 * 10 // MERGE ** 2  # 4 frames -> 2 temporal patches of 6x10
    assert sum(int((mb.input_ids == video_id).sum()) for mb in batch.micro_batches) == 3 * per_video
    no_vision = step({"vision_quad": 0.0, "vision_lin": 0.0})
    cost = cost_model_for(built, [])
    assert batch.modelled_cost - no_vision.modelled_cost >= \
        3 * cost.encoder_cost("vision", [60, 60]).sum() * (1 - 1e-9)
    model = built.model
    model.zero_grad()
    for mb in batch.micro_batches:
        out = model(mb)
        assert torch.isfinite(out.loss_sum)
        out.loss_sum.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for p in model.encoders["vision"].tower.parameters())
    model.zero_grad()
