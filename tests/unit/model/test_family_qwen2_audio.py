"""Qwen2-Audio: OmniModel parity with HF (logits, loss, gradients), exact round trip, bad audio.

The tiny model's audio window is 1 s (100 mel frames, 50 encoder positions, at most 25 embeddings
per clip), so a clip's length decides how many embeddings it yields, and a 1.3 s clip is cut.
"""

import copy
import io

import numpy as np
import pytest
import torch

from ds_omni.errors import DataError, ModelError
from tests.family_checks import (assert_logits_match, assert_loss_and_grads_match,
                                 assert_round_trip, load_omni, processor_for)
from tests.family_dirs import (RATE, make_qwen2_audio_dir)



def _sine(rng, seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    freq, amp = rng.uniform(150, 2000), rng.uniform(0.1, 0.9)
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _wav_bytes(waveform: np.ndarray, rate: int = RATE) -> bytes:
    import soundfile as sf
    buf = io.BytesIO()
    sf.write(buf, waveform, rate, format="WAV", subtype="FLOAT")  # float WAV: decodes exactly
    return buf.getvalue()


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory):
    return make_qwen2_audio_dir(tmp_path_factory.mktemp("qwen2_audio"))

@pytest.fixture(scope="module")
def built(audio_dir):
    return load_omni(audio_dir)


@pytest.fixture(scope="module")
def reference(audio_dir):
    from transformers import Qwen2AudioForConditionalGeneration
    return Qwen2AudioForConditionalGeneration.from_pretrained(str(audio_dir))


@pytest.fixture(scope="module")
def hf_proc(audio_dir):
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(str(audio_dir))


@pytest.fixture(scope="module")
def clips():
    """Raw waveforms of different lengths; the last is longer than the window."""
    rng = np.random.default_rng(7)
    return [_sine(rng, s) for s in (0.37, 0.81, 0.55, 1.3)]


def _samples(built, clips):
    """(sample, the waveforms HF gets for it): one clip, no clip, three clips in three forms."""
    proc = processor_for(built, max_seq_len=512)
    one = [{"from": "human", "value": "<audio>\nWhat is this sound?"},
           {"from": "gpt", "value": "A red circle."}]
    three = [{"from": "human", "value": "<audio> or <audio> or <audio>?"},
             {"from": "gpt", "value": "the first"}]
    media_three = [{"bytes": _wav_bytes(clips[1]), "path": None}, clips[2],
                   {"array": clips[3], "sampling_rate": RATE}]
    return [
        (proc(text=one, media={"audio": [{"array": clips[0], "sampling_rate": RATE}]},
              sample_id="one", source="t"), clips[:1]),
        (proc(text="a caption with no audio at all", media={}, sample_id="text", source="t"), []),
        (proc(text=three, media={"audio": media_three}, sample_id="three", source="t"), clips[1:]),
    ]


def _hf_inputs_fn(hf_proc, pairs):
    """HF reference inputs of a sample: our input_ids, features exactly as HF's processor makes."""
    by_id = {s.sample_id: waves for s, waves in pairs}

    def hf_inputs(sample):
        waves = by_id[sample.sample_id]
        if not waves:
            return {"input_ids": sample.input_ids[None]}
        out = hf_proc(text=hf_proc.audio_token * len(waves), audio=waves, sampling_rate=RATE,
                      return_tensors="pt")
        return {"input_ids": sample.input_ids[None], "input_features": out["input_features"],
                "feature_attention_mask": out["feature_attention_mask"]}
    return hf_inputs


def test_logits_match_hf(built, reference, hf_proc, clips):
    pairs = _samples(built, clips)
    samples = [s for s, _ in pairs]
    assert [len(s.items) for s in samples] == [1, 0, 3]
    counts = [item.num_embeddings for s in samples for _, item in s.items]
    assert len(set(counts)) == 4 and counts[-1] == 25  # all lengths differ; the 1.3 s clip is cut
    assert_logits_match(built, reference, samples, _hf_inputs_fn(hf_proc, pairs))


def test_loss_and_gradients_match_hf(built, reference, hf_proc, clips):
    pairs = _samples(built, clips)
    assert_loss_and_grads_match(built, reference, [s for s, _ in pairs], _hf_inputs_fn(hf_proc, pairs))


def test_micro_batch_without_audio_still_runs_the_encoder(built, reference, hf_proc, clips):
    """ZeRO-3 needs every rank to run every encoder: a text-only batch runs a dummy clip."""
    pairs = _samples(built, clips)[1:2]
    assert_loss_and_grads_match(built, reference, [s for s, _ in pairs], _hf_inputs_fn(hf_proc, pairs))
    tower = built.model.encoders["audio"].tower
    grads = [p.grad for p in tower.parameters() if p.requires_grad]
    assert grads and all(g is not None and not g.any() for g in grads)


@pytest.mark.parametrize("seconds", [0.021, 0.37, 0.5, 0.999, 1.0, 2.4])
def test_clip_tokens_and_features_match_theaudio_hf_processor(built, hf_proc, seconds):
    """One clip: the same token run as HF's template + processor, and bitwise the same features."""
    wave = _sine(np.random.default_rng(int(seconds * 1000)), seconds)
    wrapped = hf_proc.audio_bos_token + hf_proc.audio_token + hf_proc.audio_eos_token
    out = hf_proc(text=wrapped, audio=[wave], sampling_rate=RATE, return_tensors="pt")
    proc = built.item_processors["audio"]
    item = proc.process(wave)
    assert proc.tokens(item) == out["input_ids"][0].tolist()
    assert item.num_embeddings == int((out["input_ids"] == proc.placeholder_id).sum())
    assert torch.equal(item.inputs["input_features"], out["input_features"][0])
    assert torch.equal(item.inputs["feature_attention_mask"], out["feature_attention_mask"][0])
    assert item.meta["frames"] == int(out["feature_attention_mask"].sum())


def test_extractor_built_from_the_config_matches_the_saved_one(built, clips):
    """Without preprocessor_config.json the extractor is made to fit the encoder's window."""
    fallback = built.family.item_processors(built.hf_config, None, tokenizer=built.tokenizer)["audio"]
    ours, theirs = fallback.process(clips[0]), built.item_processors["audio"].process(clips[0])
    assert torch.equal(ours.inputs["input_features"], theirs.inputs["input_features"])
    assert ours.num_embeddings == theirs.num_embeddings


def test_export_round_trip_is_exact(built, reference, tmp_path, clips):
    assert_round_trip(built, tmp_path / "export", reference)
    from transformers import AutoProcessor
    exported = AutoProcessor.from_pretrained(str(tmp_path / "export"))
    assert type(exported).__name__ == "Qwen2AudioProcessor"
    out = exported(text=exported.audio_token, audio=[clips[0]], sampling_rate=RATE)
    assert exported.audio_token_id == built.hf_config.audio_token_id
    assert out["input_ids"][0].count(exported.audio_token_id) == \
        built.item_processors["audio"].process(clips[0]).num_embeddings


def test_saved_processor_expands_the_model_audio_token(built, tmp_path):
    """A tokenizer naming another audio token ("<audio>") must not leak into the saved processor."""
    from transformers import AutoProcessor
    tok = copy.deepcopy(built.tokenizer)
    tok.audio_token = "<audio>"
    built.family.save_processor(tmp_path, built.hf_config, tok, built.model_dir)
    assert tok.audio_token == "<audio>"  # the caller's tokenizer is left alone
    assert AutoProcessor.from_pretrained(str(tmp_path)).audio_token_id == built.hf_config.audio_token_id


def test_dummy_inputs_give_finite_embeddings(built):
    encoder = built.model.encoders["audio"]
    with torch.no_grad():
        out = encoder(encoder.dummy_inputs("cpu", torch.float32))
    assert out.ndim == 2 and out.shape[1] == built.hf_config.text_config.hidden_size
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("clip, message", [
    ({"array": np.zeros(8000, np.float32), "sampling_rate": 44100}, "sampled at 44100 Hz but"),
    ({"bytes": _wav_bytes(np.zeros(8000, np.float32), 22050), "path": None}, "sampled at 22050 Hz"),
    ({"bytes": b"RIFF\x00\x00not audio at all", "path": None}, "unreadable audio"),
    ({"path": "/no/such/clip.wav"}, "'/no/such/clip.wav' does not exist"),
    (np.zeros((2, 8000), np.float32), r"shape \(2, 8000\); expected mono"),
    (np.full(8000, np.nan, np.float32), "NaN"),
    (np.zeros(100, np.float32), "too short"),
    (np.zeros(0, np.float32), "empty"),
    ("not a clip".encode(), "unreadable audio"),
    (12, "cannot read audio from a int"),
])
def test_bad_audio_is_a_data_error_naming_the_sample(built, clip, message):
    proc = processor_for(built)
    with pytest.raises(DataError, match=message) as err:
        proc(text="<audio> hi", media={"audio": [clip]}, sample_id="bad-7", source="clips")
    assert "source 'clips' sample bad-7: " in str(err.value)


def test_tokenizer_without_audio_wrappers_is_a_clear_error(built):
    from transformers import AutoTokenizer
    from ds_omni.data.demo import ensure_builtin
    plain = AutoTokenizer.from_pretrained(str(ensure_builtin("builtin:shapes", "tokenizer")))
    with pytest.raises(ModelError, match="no '<\\|audio_bos\\|>' token"):
        built.family.item_processors(built.hf_config, built.model_dir, tokenizer=plain)


def test_freezing_parts(audio_dir, clips):
    from ds_omni.data.packing import pack
    built = load_omni(audio_dir, freeze=["audio", "llm"])
    model = built.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("encoders.audio.projector.") for n in trainable)
    model(pack([s for s, _ in _samples(built, clips)[:1]], built.item_processors)).loss_sum.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    with pytest.raises(ModelError, match="has no vision part"):
        load_omni(audio_dir, freeze=["vision"])
