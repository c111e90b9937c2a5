"""Tiny configs shared by the tests: models build in milliseconds, data comes from builtin:shapes."""

from __future__ import annotations

import copy

TINY_VISION = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 32, "patch_size": 8}
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": False}


def tiny_config_dict(output_dir: str, **train) -> dict:
    """A whole OmniConfig as JSON-able dict (tiny LLaVA composition on the demo data)."""
    return {
        "model": {"tokenizer": "builtin:shapes", "vision": {"config": dict(TINY_VISION)},
                  "llm": {"config": dict(TINY_LLAMA)}},
        "data": {"sources": [{"name": "shapes", "path": "builtin:shapes"}], "max_seq_len": 128},
        "train": {"steps": 2, "global_batch_size": 8, "micro_batch_size": 2, "lr": 1e-3,
                  "output_dir": output_dir, "export_hf": False, **train},
    }


def tiny_config(output_dir: str, **train):
    from ds_omni.config import from_dict, OmniConfig
    return from_dict(OmniConfig, copy.deepcopy(tiny_config_dict(output_dir, **train)))


ADAM_EPS = 1e-6


def ds_config(stage: int, **extra) -> dict:
    """A DeepSpeed config for tests: constant LR (no scheduler), AdamW as torch implements it.

    eps is 1e-6, not 1e-8: some gradients are zero in exact arithmetic (a key bias cannot change a
    softmax) and hold only float noise, whose order depends on the reduction; a tiny eps turns that
    noise into full-size Adam steps of either sign. 1e-6 keeps real updates unchanged.
    """
    return {"zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                      "betas": [0.9, 0.95], "eps": ADAM_EPS,
                                                      "torch_adam": True}},
            "gradient_clipping": 1.0, **extra}


def text_source(tmp_path, weight: float = 3.0) -> dict:
    """A jsonl source of 64 plain sentences: micro-batches with nothing to encode."""
    import json
    rows = [{"id": f"t{i}", "text": f"A plain sentence number {i} with no picture."} for i in range(64)]
    path = tmp_path / "text.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return {"name": "text", "path": str(path), "weight": weight,
            "schema": {"text": "text", "image": None}}


def long_source(tmp_path, weight: float = 1.0, n: int = 16, words: int = 40,
                images: int | tuple[int, ...] = 1) -> dict:
    """A jsonl source of shapes images (`images` a sample, or row i has images[i % len]) with long
    answers (about 4 tokens a word): sequences that cost more than a rank's share of a tiny step,
    so per-sequence SP gives them a block."""
    import json
    from ds_omni.data.demo import shapes_rows
    counts = (images,) if isinstance(images, int) else images
    rows = []
    shapes = shapes_rows(n * max(counts), seed=7)
    for i, row in enumerate(shapes[:n]):
        count, names = counts[i % len(counts)], []
        for k in range(count):
            names.append(f"long{i}" + (f"_{k}" if k else "") + ".png")
            (tmp_path / names[-1]).write_bytes(shapes[i + k * n]["image"]["bytes"])
        question = row["conversations"][0]["value"]
        caption = row["conversations"][1]["value"]
        answer = " ".join([caption] * max(1, words // len(caption.split())))
        if count > 1:  # half the words before the images: they sit mid-row, across shards
            half = answer.split()
            question = " ".join(half[:len(half) // 2]) + "\n" + "<image>\n" * (count - 1) + question
            answer = " ".join(half[len(half) // 2:])
        rows.append({"id": f"long{i}", "image": names[0] if count == 1 else names,
                     "conversations": [{"from": "human", "value": question},
                                       {"from": "gpt", "value": answer}]})
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return {"name": "long", "path": str(path), "weight": weight}


def eval_sources(tmp_path) -> list[dict]:
    """A validation set of 5 rows: 3 pictures with captions (jsonl + PNG files) and 2 sentences;
    over 2 ranks at 2 samples per micro-batch one rank has a round with no sample left."""
    from tests.data_files import conversation_rows, text_rows, write
    shapes, shapes_schema = write("json", conversation_rows(3, seed=99, prefix="e"),
                                  tmp_path / "eval_shapes", files=1)
    text, text_schema = write("json", text_rows(2, prefix="et"), tmp_path / "eval_text", files=1)
    return [{"name": "eval_shapes", "path": shapes, "schema": shapes_schema},
            {"name": "eval_text", "path": text, "schema": text_schema}]
