"""Feed rate: samples, tokens and items per second per CPU core for the shipped processors,
against the rate one H200 consumes them at 45 % MFU; the cores per GPU each needs.

Processors (HF's PIL ones, as ds_omni's families build them from a model config, no hub):
  - `clip336`: LLaVA-1.5's CLIP ViT-L/14-336 (`CLIPImageProcessorPil`, shortest edge 336, centre
    crop 336): 576 embeddings per image;
  - `qwen2_vl`: Qwen2-VL at native resolution (`Qwen2VLImageProcessorPil`, patch 14, merge 2,
    its default pixel range): a 640x480 image is 46 x 34 patches, 391 embeddings;
  - `siglip384`: SigLIP so400m-patch14-384 (`SiglipImageProcessorPil`, 384 x 384): 729;
  - `whisper`: Qwen2-Audio's Whisper-large-v3 front end (`WhisperFeatureExtractor`, 128 mel
    bins, 30 s window) on 10 s clips at 16 kHz: 750 embeddings per clip.
A sample is what a loader does per item: decode the stored file (`ds_omni.data.media`: a
640x480 JPEG of COCO's size and quality, or a 16-bit WAV) and run the processor. Timed as CPU
time of this one-thread process (`time.process_time`; torch, OpenMP and BLAS held to one
thread), so other jobs on the machine do not inflate it: the figures are per core. Tokenising
the text is not included (a fast tokenizer does a caption in tens of microseconds).

GPU side: model FLOPs per sample as `benchmarks/gpu_mfu.py` counts them (6 x parameters x
tokens for every matmul, plus attention: 6 x layers x width x s^2 for the causal LLM, 12 x
layers x width x s^2 for the bidirectional encoder), everything trained. Parameters are counted
on models built from configs on the meta device (no weights made). Each sample is one item plus
`--text-tokens` of text (80: the image captions of gpu_mfu's mix), for the LLM of the GPU
benchmark (~1B Llama: hidden 2048, 16 layers; ~1.4B with CLIP-L) and a 7B Llama-2 backbone,
each with the processor's own encoder tower (CLIP-L/336, Qwen2-VL's 675M ViT, SigLIP so400m,
Whisper-large-v3's encoder). Consumed rate = 45 % x 989 TFLOPS (H200 dense bf16) / FLOPs per
sample. Cores per GPU = consumed rate / one core's rate.

Writes benchmarks/results/feed_rate.json.
Run: .venv/bin/python benchmarks/feed_rate.py   (about a minute)
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # one core: set before numpy / torch start their thread pools
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[_var] = "1"

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import wave  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# DS_OMNI_BENCH_RESULTS: another folder (run_all.py's quick runs go to results/quick)
RESULTS = Path(os.environ.get("DS_OMNI_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
H200_BF16_TFLOPS = 989.0
MFU = 0.45


# ------------------------------------------------------------------------------ the inputs
def jpegs(n: int, seed: int, size=(640, 480), quality: int = 90) -> list[bytes]:
    """COCO-sized photos' stand-ins: smooth colour fields with noise (JPEG decodes them at the
    cost of a photo; flat images would decode faster)."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    w, h = size
    out = []
    for _ in range(n):
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([np.sin(xx / rng.uniform(20, 80) + c) * np.cos(yy / rng.uniform(20, 80))
                         for c in range(3)], -1) * 100 + 128
        pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


def wavs(n: int, seed: int, seconds: float = 10.0, rate: int = 16000) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = np.arange(int(seconds * rate)) / rate
        x = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 400) * t) + rng.normal(0, 0.05, t.shape)
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes((np.clip(x, -1, 1) * 32767).astype(np.int16).tobytes())
        out.append(buf.getvalue())
    return out


# ------------------------------------------------------------------------------ the processors
@dataclass(frozen=True)
class Kind:
    """A processor and the encoder tower its items feed."""

    name: str
    what: str
    embeddings: int  # LLM tokens per item (as the processor's output says; checked)
    encoder_seq: int  # the tower's positions per item


def processors() -> dict:
    from transformers import WhisperFeatureExtractor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
    return {"clip336": CLIPImageProcessorPil(size={"shortest_edge": 336},
                                             crop_size={"height": 336, "width": 336}),
            "qwen2_vl": Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2,
                                                 merge_size=2),
            "siglip384": SiglipImageProcessorPil(size={"height": 384, "width": 384}),
            "whisper": WhisperFeatureExtractor(feature_size=128, chunk_length=30)}


def process_one(name: str, proc, blob: bytes):
    """Decode one stored item and run its processor (what a loader does per item)."""
    from ds_omni.data.media import load_image, read_clip
    if name == "whisper":
        clip = read_clip({"bytes": blob, "path": "a.wav"}, 16000)
        return proc(clip, sampling_rate=16000, return_tensors="np")
    return proc(load_image({"bytes": blob, "path": "a.jpg"}), return_tensors="pt")


def embeddings_of(name: str, out) -> tuple[int, int]:
    """(LLM tokens, encoder positions) of one processed item."""
    if name == "clip336":
        return (336 // 14) ** 2, (336 // 14) ** 2 + 1
    if name == "siglip384":
        return (384 // 14) ** 2, (384 // 14) ** 2
    if name == "qwen2_vl":
        t, h, w = out["image_grid_thw"][0].tolist()
        return t * h * w // 4, t * h * w
    return 750, 1500  # Whisper: 3000 mel frames -> 1500 encoder positions -> pooled 2x


def cpu_rate(name: str, proc, blobs: list[bytes], repeats: int) -> dict:
    """Items per CPU-second (median over `repeats` passes over `blobs`), and the item's sizes."""
    out = process_one(name, proc, blobs[0])  # warm-up (imports, caches)
    per_item = []
    for _ in range(repeats):
        start = time.process_time()
        for blob in blobs:
            out = process_one(name, proc, blob)
        per_item.append((time.process_time() - start) / len(blobs))
    tokens, positions = embeddings_of(name, out)
    return {"cpu_s_per_item": statistics.median(per_item), "per_item_passes": per_item,
            "items_per_core_s": 1 / statistics.median(per_item), "embeddings": tokens,
            "encoder_positions": positions}


# ------------------------------------------------------------------------------ GPU side
def count_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def llm_specs() -> dict:
    from transformers import LlamaConfig
    return {"llava_1p4b": LlamaConfig(hidden_size=2048, intermediate_size=8192,
                                      num_hidden_layers=16, num_attention_heads=32,
                                      num_key_value_heads=8, vocab_size=32064),
            "llama2_7b": LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                     num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=32, vocab_size=32000)}


def encoder_towers() -> dict:
    """(parameters, layers, width) of each processor's tower, up to the layer the LLM reads."""
    from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    from transformers.models.whisper.configuration_whisper import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    with torch.device("meta"):
        clip = CLIPVisionModel(CLIPVisionConfig(hidden_size=1024, intermediate_size=4096,
                                                num_hidden_layers=23, num_attention_heads=16,
                                                image_size=336, patch_size=14))  # LLaVA reads -2
        siglip = SiglipVisionModel(SiglipVisionConfig(hidden_size=1152, intermediate_size=4304,
                                                      num_hidden_layers=27, num_attention_heads=16,
                                                      image_size=384, patch_size=14))
        qwen = Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(
            depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4))
        whisper = WhisperEncoder(WhisperConfig(d_model=1280, encoder_layers=32,
                                               encoder_attention_heads=20, encoder_ffn_dim=5120,
                                               num_mel_bins=128))
    return {"clip336": (count_params(clip), 23, 1024), "siglip384": (count_params(siglip), 27, 1152),
            "qwen2_vl": (count_params(qwen), 32, 1280), "whisper": (count_params(whisper), 32, 1280)}


def llm_params(cfg) -> tuple[int, int]:
    """(decoder layers + final norm, LM head) parameters of a Llama config."""
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return count_params(model.model.layers) + count_params(model.model.norm), \
        count_params(model.lm_head)


def sample_flops(llm_cfg, llm: tuple[int, int], tower: tuple[int, int, int], embeddings: int,
                 positions: int, text_tokens: int) -> float:
    """Training FLOPs of one sample: one item + `text_tokens` of text (all of them targets),
    the projector (2 layers, encoder width -> LLM width) included."""
    body, head = llm
    enc_params, enc_layers, enc_width = tower
    width, layers = llm_cfg.hidden_size, llm_cfg.num_hidden_layers
    s = embeddings + text_tokens
    projector = enc_width * width + width * width
    dense = 6 * (body * s + head * text_tokens + enc_params * positions + projector * embeddings)
    attention = 6 * layers * width * s ** 2 + 12 * enc_layers * enc_width * positions ** 2
    return float(dense + attention)


# ------------------------------------------------------------------------------ the figures
def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                "unknown")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=24, help="items per timed pass")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--text-tokens", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "feed_rate.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    images, clips = jpegs(args.items, args.seed), wavs(args.items, args.seed)
    towers, specs = encoder_towers(), llm_specs()
    llms = {k: llm_params(c) for k, c in specs.items()}
    consumed_flops = MFU * H200_BF16_TFLOPS * 1e12
    out = {"command": "python benchmarks/feed_rate.py", "mfu": MFU,
           "gpu_peak_tflops": H200_BF16_TFLOPS, "text_tokens": args.text_tokens,
           "cpu": _cpu_model(), "load_1min": os.getloadavg()[0], "processors": {}}
    for name, proc in processors().items():
        cpu = cpu_rate(name, proc, clips if name == "whisper" else images, args.repeats)
        row = {**cpu, "tokens_per_core_s": cpu["items_per_core_s"] * (cpu["embeddings"]
                                                                      + args.text_tokens)}
        for llm, cfg in specs.items():
            flops = sample_flops(cfg, llms[llm], towers[name], cpu["embeddings"],
                                 cpu["encoder_positions"], args.text_tokens)
            gpu = consumed_flops / flops
            row[llm] = {"sample_tflop": flops / 1e12, "gpu_samples_per_s": gpu,
                        "gpu_tokens_per_s": gpu * (cpu["embeddings"] + args.text_tokens),
                        "cores_per_gpu": gpu / cpu["items_per_core_s"],
                        "workers_per_gpu": math.ceil(gpu / cpu["items_per_core_s"])}
        row["encoder_params"] = towers[name][0]
        out["processors"][name] = row
        print(f"{name}: {cpu['items_per_core_s']:.1f} items/core/s; cores per H200: "
              f"{row['llava_1p4b']['cores_per_gpu']:.1f} (1.4B), "
              f"{row['llama2_7b']['cores_per_gpu']:.1f} (7B)")
    out["llm_params"] = {k: sum(v) for k, v in llms.items()}
    out["load_1min_after"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
