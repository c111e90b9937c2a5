"""Qwen2-Audio: a Whisper-style audio encoder, a linear projector, a Qwen2 LLM.

A clip is cut or padded to the feature extractor's 30 s window (as HF's processor does). The
encoder runs on the whole window (its position table has one row per position) but attends only
to the clip's frames, and only their embeddings are kept: L valid mel frames -> (L - 1) // 2 + 1
after the stride-2 conv -> (that - 2) // 2 + 1 after the 2x pool. In the text a clip is
`<|audio_bos|> <|AUDIO|> * n <|audio_eos|>`. A dedicated file because the generic adapter covers
image-text-to-text models only.

Dims: N clips, M mel bins, F mel frames of the window, S = F / 2 encoder positions, E embeddings
kept of all clips, C encoder width, D LLM width.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ds_omni.batch import EncodedItem, ItemProcessor
from ds_omni.data.media import read_clip
from ds_omni.errors import DataError, ModelError
from ds_omni.model.families.registry import register
from ds_omni.model.family import Family
from ds_omni.model.omni import ModalityEncoder, OmniModel, backbone_of
from ds_omni.parallel import long_short
from ds_omni.parallel.long_short import EncoderShard

AUDIO_BOS, AUDIO_EOS = "<|audio_bos|>", "<|audio_eos|>"
WHISPER_RATE, WHISPER_HOP = 16000, 160  # WhisperFeatureExtractor defaults


def num_embeddings(frames: int) -> int:
    """Embeddings of a clip with `frames` valid mel frames (HF processor's formula)."""
    return (((frames - 1) // 2 + 1) - 2) // 2 + 1


class Qwen2AudioClipEncoder(ModalityEncoder):
    """input_features [N, M, F] + feature_attention_mask [N, F] -> embeddings [E, D], clip by clip."""

    modality = "audio"

    def encode(self, inputs, shard: EncoderShard | None = None):
        """With `shard` (one long clip): this rank's rows, its layers running on a piece of the
        window's S positions and attending over all of them through Ulysses attention."""
        from transformers.masking_utils import create_bidirectional_mask
        feats = inputs["input_features"]  # [N, M, F]
        frames = inputs["feature_attention_mask"].sum(-1)  # [N] valid mel frames
        conv_lengths, out_lengths = self.tower._get_feat_extract_output_lengths(frames)
        positions = self.positions(feats)  # S, after the stride-2 conv
        valid = torch.arange(positions, device=feats.device)[None] < conv_lengths[:, None]  # [N, S]
        # The same padding mask HF builds: keys past the clip's end are hidden from every query.
        mask = create_bidirectional_mask(config=self.tower.config,
                                         inputs_embeds=feats.new_zeros(feats.shape[0], positions, 1),
                                         attention_mask=valid.long())
        first = 0
        with contextlib.ExitStack() as pieces:
            if shard is not None:
                pieces.enter_context(long_short.sharded(self.tower.config, shard))
                pieces.enter_context(long_short.cut_input(self.tower.layers[0], shard, dim=1))
                first = shard.lo // 2  # the piece's first pooled row
            hidden = self.tower(feats, attention_mask=mask).last_hidden_state  # [N, S / 2, C]
        rows = first + torch.arange(hidden.shape[1], device=feats.device)
        keep = rows[None] < out_lengths[:, None]
        return self.projector(hidden[keep])  # [N, S / 2, C] -> [E, C] -> [E, D], clips in order

    @staticmethod
    def positions(feats: torch.Tensor) -> int:
        return (feats.shape[-1] - 2) // 2 + 1  # S: positions after the stride-2 conv

    # A long clip: each pooled row is 2 positions; the last piece also takes the padded tail.
    def attention_heads(self):
        return self.tower.config.encoder_attention_heads

    def piece_tokens(self, inputs, rows):
        return (*(2 * r for r in rows[:-1]), self.positions(inputs["input_features"]))

    def encode_piece(self, inputs, shard):
        return self.encode(inputs, shard)

    def window_frames(self) -> int:
        """F: the tower accepts only full windows (one position-table row per conv output)."""
        tower = self.tower
        return tower.config.max_source_positions * tower.conv1.stride[0] * tower.conv2.stride[0]

    def dummy_inputs(self, device, dtype):
        frames = self.window_frames()
        # A silent, fully valid window: a clip of 0 frames would leave every key masked (NaN).
        return {"input_features": torch.zeros(1, self.tower.config.num_mel_bins, frames,
                                              device=device, dtype=dtype),
                "feature_attention_mask": torch.ones(1, frames, device=device, dtype=torch.int32)}


class WhisperClipProcessor(ItemProcessor):
    """Raw clip -> log-mel window [M, F] and its frame mask [F], through HF's feature extractor."""

    encoder = "audio"
    modality = "audio"

    def __init__(self, feature_extractor, placeholder_id: int, bos_id: int, eos_id: int):
        self.feature_extractor = feature_extractor
        self.placeholder_id = placeholder_id
        self.bos_id, self.eos_id = bos_id, eos_id

    def process(self, clip):
        fe = self.feature_extractor
        waveform = read_clip(clip, fe.sampling_rate)
        # The call HF's Qwen2AudioProcessor makes: pad to the window, frame-level mask.
        out = fe([waveform], sampling_rate=fe.sampling_rate, padding="max_length",
                 return_attention_mask=True, return_tensors="pt")
        mask = out["attention_mask"][0]  # [F]
        frames = int(mask.sum())
        n = self.count(frames)
        if n < 1:
            raise DataError(f"audio clip of {waveform.shape[0]} samples is too short: it yields no "
                            f"embedding (needs more than {2 * fe.hop_length} samples)")
        return EncodedItem(inputs={"input_features": out["input_features"][0],
                                   "feature_attention_mask": mask},
                           num_embeddings=n, meta={"frames": frames, "window_frames": mask.shape[0],
                                                   "truncated": waveform.shape[0] > fe.n_samples},
                           encoder_seqs=[mask.shape[0] // 2])

    def count(self, frames: int) -> int:
        """Embeddings of a clip with `frames` valid mel frames."""
        return num_embeddings(frames)

    def tokens(self, item):
        return [self.bos_id] + [self.placeholder_id] * item.num_embeddings + [self.eos_id]


def feature_extractor(audio_config, model_dir: Path | None):
    """The extractor saved with the model, else a Whisper one whose window fits the encoder."""
    if model_dir is not None and (Path(model_dir) / "preprocessor_config.json").exists():
        from transformers import AutoFeatureExtractor
        fe = AutoFeatureExtractor.from_pretrained(str(model_dir))
    else:
        from transformers import WhisperFeatureExtractor
        window_s = audio_config.max_source_positions * 2 * WHISPER_HOP / WHISPER_RATE
        if window_s != int(window_s):
            raise ModelError(f"audio max_source_positions={audio_config.max_source_positions} is not "
                             "a whole number of seconds at 16 kHz / hop 160; save the model's "
                             "preprocessor_config.json (WhisperFeatureExtractor) next to it")
        fe = WhisperFeatureExtractor(feature_size=audio_config.num_mel_bins, chunk_length=int(window_s))
    _check_extractor(fe, audio_config)
    return fe


def _check_extractor(fe, audio_config) -> None:
    window = 2 * audio_config.max_source_positions
    if fe.feature_size != audio_config.num_mel_bins or fe.nb_max_frames != window:
        raise ModelError(f"the feature extractor makes {fe.feature_size} mel bins x "
                         f"{fe.nb_max_frames} frames but the audio encoder takes "
                         f"{audio_config.num_mel_bins} x {window}; fix preprocessor_config.json "
                         "(feature_size, chunk_length) to match the model's audio_config")


def wrapper_tokens(tokenizer) -> tuple[str, str]:
    """The clip's opening and closing tokens, as Qwen2AudioProcessor picks them."""
    return (getattr(tokenizer, "audio_bos_token", None) or AUDIO_BOS,
            getattr(tokenizer, "audio_eos_token", None) or AUDIO_EOS)


def token_id(tokenizer, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ModelError(f"the tokenizer has no {token!r} token; Qwen2-Audio wraps each clip in "
                         f"{AUDIO_BOS}...{AUDIO_EOS}: add them as special tokens (and resize the "
                         "embeddings) or use the model's own tokenizer")
    return tid


def processor_tokenizer(tokenizer, audio_token: str):
    """`tokenizer`, or a copy naming `audio_token` as its audio token.

    Qwen2AudioProcessor takes its audio token from the tokenizer's `audio_token` attribute when
    there is one, over its own argument; a tokenizer naming another token (ds_omni's demo tokenizer
    names "<audio>") would make the saved processor expand the wrong token.
    """
    if getattr(tokenizer, "audio_token", audio_token) == audio_token:
        return tokenizer
    import copy
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.audio_token = audio_token
    return tokenizer


class Qwen2Audio(Family):
    name = "qwen2_audio"
    model_types = ("qwen2_audio",)
    hf_class = "Qwen2AudioForConditionalGeneration"

    def to_omni(self, hf_model, tokenizer=None) -> OmniModel:
        inner = hf_model.model
        encoder = Qwen2AudioClipEncoder(tower=inner.audio_tower, projector=inner.multi_modal_projector,
                                    placeholder_id=hf_model.config.audio_token_id)
        return OmniModel(encoders={"audio": encoder},
                         backbone=backbone_of(inner.language_model, hf_model.lm_head, hf_model),
                         family=self, hf_model=hf_model)

    def item_processors(self, hf_config, model_dir=None, tokenizer=None):
        if tokenizer is None:
            raise ModelError("qwen2_audio: the item processor needs the tokenizer (for the "
                             f"{AUDIO_BOS}/{AUDIO_EOS} ids); pass tokenizer=")
        bos, eos = (token_id(tokenizer, t) for t in wrapper_tokens(tokenizer))
        fe = feature_extractor(hf_config.audio_config, model_dir)
        return {"audio": WhisperClipProcessor(fe, hf_config.audio_token_id, bos, eos)}

    def save_processor(self, out_dir, hf_config, tokenizer, model_dir=None):
        from transformers import Qwen2AudioProcessor
        audio_token = tokenizer.convert_ids_to_tokens(hf_config.audio_token_id)
        bos, eos = wrapper_tokens(tokenizer)
        Qwen2AudioProcessor(
            feature_extractor=feature_extractor(hf_config.audio_config, model_dir),
            tokenizer=processor_tokenizer(tokenizer, audio_token),
            chat_template=getattr(tokenizer, "chat_template", None), audio_token=audio_token,
            audio_bos_token=bos, audio_eos_token=eos).save_pretrained(str(out_dir))


register(Qwen2Audio())
