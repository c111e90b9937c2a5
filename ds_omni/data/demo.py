"""The embedded demo data: pictures of coloured shapes with captions, and a tokenizer for them.

Both are made locally from a seed at first use (no download) and stored in the formats a real run
uses: parquet shards with PNG bytes that HF `datasets` loads (LLaVA conversation schema), and a
`PreTrainedTokenizerFast` trained with `tokenizers`. A config refers to them as "builtin:shapes".
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
IMAGE_SIZE = 32
SMALL_R, LARGE_R = 5.5, 9.5  # shape radii in pixels (before a +-0.5 px jitter)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<image>", "<audio>"]

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220),
           "yellow": (230, 210, 40), "purple": (140, 50, 170), "orange": (240, 140, 30)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128)}
SHAPES = ("circle", "square", "triangle")
PLACES = {"top left": (0.3, 0.3), "top right": (0.7, 0.3), "bottom left": (0.3, 0.7),
          "bottom right": (0.7, 0.7), "center": (0.5, 0.5)}
QUESTIONS = ("What is in the picture?", "Describe the image.", "What do you see?",
             "What shape is shown?")


def default_cache_dir() -> Path:
    """Where builtin data is made: $DS_OMNI_CACHE, else .cache/ds_omni under the working dir."""
    return Path(os.environ.get("DS_OMNI_CACHE", ".cache/ds_omni")).resolve()


def is_builtin(path: str | None) -> bool:
    return bool(path) and path.startswith(BUILTIN_PREFIX)


BUILTINS = ("shapes", "shapes_eval", "shapes_tones", "tones")  # all share the "shapes" tokenizer
# builtin:shapes_eval, the demo's validation source: the training set's distribution drawn from
# another seed than both the training set (0) and `evaluate_captions`' held-out images (12345)
EVAL_ROWS, EVAL_SEED = 128, 777
ASSET_VERSION = 3  # bump when generated assets change, so stale caches are not reused


def builtin_dir(uri: str, kind: str) -> Path:
    """The directory a builtin asset lives in (it may not exist yet)."""
    name = uri[len(BUILTIN_PREFIX):]
    if name not in BUILTINS:
        from ds_omni.errors import ConfigError
        raise ConfigError(f"unknown builtin asset {uri!r}; builtins are "
                          f"{[BUILTIN_PREFIX + b for b in BUILTINS]}")
    if kind == "tokenizer":
        name = "shapes"
    return default_cache_dir() / f"{name}-{kind}-v{ASSET_VERSION}"


def ensure_builtin(uri: str, kind: str) -> Path:
    """Return the directory of builtin asset `uri` ("dataset" or "tokenizer"), making it if absent.

    Several ranks may call this at once: the asset is written to a temporary directory and renamed,
    so a reader sees either nothing or the whole asset.
    """
    out = builtin_dir(uri, kind)
    if (out / "_complete").exists():
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    if kind == "tokenizer":
        make_shapes_tokenizer(tmp)
    elif out.name.startswith("shapes_tones"):
        make_shapes_tones_dataset(tmp)
    elif out.name.startswith("tones"):
        make_shapes_tones_dataset(tmp, with_images=False)
    elif out.name.startswith("shapes_eval"):
        make_shapes_dataset(tmp, n=EVAL_ROWS, shards=1, seed=EVAL_SEED)
    else:
        make_shapes_dataset(tmp)
    (tmp / "_complete").touch()
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _draw(colour: str, shape: str, place: str, big: bool, background: str, rng: random.Random):
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUNDS[background])
    draw = ImageDraw.Draw(img)
    # radius: a small shape is ~11 px across, a large one ~19 px (on 32 px, 8-px patches), so the
    # outline of a small triangle, circle or square covers several patches and is legible
    cx, cy = (c * IMAGE_SIZE + rng.uniform(-1.0, 1.0) for c in PLACES[place])
    r = (LARGE_R if big else SMALL_R) + rng.uniform(-0.5, 0.5)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def shapes_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` samples in the LLaVA conversation schema: id, image (PNG bytes), conversations."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        place, big = rng.choice(list(PLACES)), rng.random() < 0.5
        background = rng.choice([b for b in BACKGROUNDS])
        caption = (f"A {'large' if big else 'small'} {colour} {shape} at the {place} "
                   f"on a {background} background.")
        rows.append({
            "id": f"shapes-{i:06d}",
            "image": {"bytes": _draw(colour, shape, place, big, background, rng), "path": None},
            "conversations": [{"from": "human", "value": f"<image>\n{rng.choice(QUESTIONS)}"},
                              {"from": "gpt", "value": caption}],
        })
    return rows


def make_shapes_dataset(out: Path, n: int = 4000, shards: int = 4, seed: int = 0) -> Path:
    """Write the demo dataset as `shards` parquet files that `datasets` loads with an Image column."""
    import datasets
    features = datasets.Features({
        "id": datasets.Value("string"),
        "image": datasets.Image(),
        "conversations": datasets.List({"from": datasets.Value("string"),
                                        "value": datasets.Value("string")}),
    })
    ds = datasets.Dataset.from_list(shapes_rows(n, seed), features=features)
    out.mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        ds.shard(num_shards=shards, index=k, contiguous=True).to_parquet(
            str(out / f"train-{k:05d}-of-{shards:05d}.parquet"))
    return out


def tokenizer_corpus() -> list[str]:
    words = [*COLOURS, *SHAPES, *BACKGROUNDS, *" ".join(PLACES).split()]
    lines = [f"A large {c} {s} at the {p} on a {b} background." for c in COLOURS for s in SHAPES
             for p in PLACES for b in BACKGROUNDS]
    lines += [f"A small {w}" for w in words] + [f"USER: {q}\nASSISTANT:" for q in QUESTIONS]
    lines += [f"{tones_caption(n, p)} {TONE_QUESTION} What do you hear?" for n in TONE_COUNTS
              for p in TONE_PITCHES]
    return lines


def make_shapes_tokenizer(out: Path, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE tokenizer on the caption corpus and save it for `AutoTokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>",
                                   extra_special_tokens={"image_token": "<image>",
                                                         "audio_token": "<audio>"})
    fast.save_pretrained(str(out))
    return out


def evaluate_captions(hf_dir: str | Path, n: int = 64, seed: int = 12345) -> dict:
    """Caption held-out shapes with an exported model (HF `generate`), and score the words.

    The held-out images come from another seed than the training set. Returns exact-match rate, the
    accuracy of each attribute (size, colour, shape, place, background) and a few examples.
    """
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    processor = AutoProcessor.from_pretrained(str(hf_dir))
    model = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
    attrs = {"size": 1, "colour": 2, "shape": 3}
    hits = {k: 0 for k in [*attrs, "place", "background", "exact"]}
    examples = []
    for row in shapes_rows(n, seed):
        question = row["conversations"][0]["value"].split("\n", 1)[1]
        prompt = f"<s>USER: <image>\n{question}\nASSISTANT: "
        image = Image.open(io.BytesIO(row["image"]["bytes"]))
        inputs = processor(images=[image], text=prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
        got = processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        want = row["conversations"][1]["value"]
        g, w = got.split(), want.split()
        for name, i in attrs.items():
            hits[name] += len(g) > i and g[i] == w[i]
        hits["place"] += " ".join(w[5:7]) in got or (w[5] == "center" and "center" in got)
        hits["background"] += len(g) > 2 and g[-2:] == w[-2:]
        hits["exact"] += got == want
        if len(examples) < 4:
            examples.append({"want": want, "got": got})
    return {"n": n, **{f"{k}_accuracy": v / n for k, v in hits.items()}, "examples": examples}


# ----------------------------------------------------------------------------- shapes + tones
SAMPLE_RATE = 16_000
TONE_COUNTS = {1: "One", 2: "Two", 3: "Three"}
TONE_PITCHES = {"low": 330.0, "high": 880.0}
TONE_QUESTION = "Describe the picture and the sound."


def tones_caption(count: int, pitch: str) -> str:
    return f"{TONE_COUNTS[count]} {pitch} beep{'s' if count > 1 else ''}."


def _beeps(count: int, pitch: str, rng: random.Random) -> bytes:
    """`count` beeps of one pitch as 16 kHz mono WAV bytes (at most 0.7 s)."""
    import numpy as np
    import soundfile as sf
    beep, gap = int(0.12 * SAMPLE_RATE), int(0.08 * SAMPLE_RATE)
    t = np.arange(beep) / SAMPLE_RATE
    tone = 0.4 * np.sin(2 * np.pi * TONE_PITCHES[pitch] * (1 + rng.uniform(-0.02, 0.02)) * t)
    lead = np.zeros(int(rng.uniform(0.0, 0.05) * SAMPLE_RATE))
    wave = np.concatenate([lead] + [np.concatenate([tone, np.zeros(gap)]) for _ in range(count)])
    buf = io.BytesIO()
    sf.write(buf, wave.astype(np.float32), SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def make_shapes_tones_dataset(out: Path, n: int = 2000, shards: int = 2, seed: int = 1,
                              with_images: bool = True) -> Path:
    """Image + audio + text samples (a shape picture and a few beeps, described together), or
    audio + text alone (`with_images=False`)."""
    import datasets
    rng = random.Random(seed)
    rows = shapes_rows(n, seed)
    for row in rows:
        count, pitch = rng.choice(list(TONE_COUNTS)), rng.choice(list(TONE_PITCHES))
        row["audio"] = {"bytes": _beeps(count, pitch, rng), "path": None}
        caption = row["conversations"][1]["value"]
        if with_images:
            prompt, answer = f"<image>\n<audio>\n{TONE_QUESTION}", f"{caption} {tones_caption(count, pitch)}"
        else:
            del row["image"]
            prompt, answer = "<audio>\nWhat do you hear?", tones_caption(count, pitch)
        row["conversations"] = [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]
    features = datasets.Features({
        "id": datasets.Value("string"),
        "conversations": datasets.List({"from": datasets.Value("string"),
                                        "value": datasets.Value("string")}),
        "audio": {"bytes": datasets.Value("binary"), "path": datasets.Value("string")},
        **({"image": datasets.Image()} if with_images else {})})
    ds = datasets.Dataset.from_list(rows, features=features)
    out.mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        ds.shard(num_shards=shards, index=k, contiguous=True).to_parquet(
            str(out / f"train-{k:05d}-of-{shards:05d}.parquet"))
    return out
