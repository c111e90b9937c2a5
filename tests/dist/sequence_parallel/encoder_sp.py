"""Long-short SP inside the encoders (`parallel.encoder_sp`): the 2-rank launch first checks
each encoder kind's split item against the item encoded whole (tests/encoder_pieces.py). The
static cases of SPLIT_ALL (static.py) then train with every image and clip split.
"""

from tests.dist.sequence_parallel.harness import make_config


def train(rank, launch, families, out_dir) -> dict:
    return {"pieces": _pieces(families, out_dir) if launch.world == 2 else {}}


def check(launch, families, tmp_path) -> None:
    results = launch.results
    for name, got in results[0]["pieces"].items():
        assert got["piece_rows"] < got["rows"], name  # the item really was split
        assert got["row_diff"] <= 1e-6 * got["row_scale"], (name, got)
        assert got["grad_diff"] <= 1e-5 * got["grad_scale"], (name, got)
    assert len(results[0]["pieces"]) == (8 if launch.world == 2 else 0)


def _pieces(families, out_dir) -> dict:
    """Every encoder kind, one long item split over 2 ranks against the item encoded whole
    (tests/encoder_pieces.py); the Qwen2-VL tower also with its layers recomputed in backward."""
    import numpy as np
    import torch
    from PIL import Image
    import torch.distributed as dist
    from pathlib import Path
    from ds_omni.model.build import build_model
    from tests.data_files import write_video
    from tests.encoder_pieces import check_pieces
    rng = np.random.default_rng(0)
    raw = {"image": Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)),
           "audio": {"array": 0.1 * rng.standard_normal(16000).astype(np.float32),
                     "sampling_rate": 16000}}
    out = {}
    for family in ("llava", "composed", "qwen2_vl", "qwen2_audio"):
        torch.manual_seed(0)  # the same random towers on both ranks
        built = build_model(make_config(families[family], out_dir, sp=1, reorder=False).model)
        for name, encoder in built.model.encoders.items():
            out[f"{family}/{name}"] = check_pieces(built, name, raw[encoder.modality])
        if family == "qwen2_vl":
            out["qwen2_vl/vision/recomputed"] = check_pieces(built, "vision", raw["image"],
                                                             checkpointed=True)
            # a video: 6 temporal patches, whose frames the pieces' attention keeps apart
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            video = write_video(Path(out_dir) / f"long_rank{dist.get_rank()}.mp4", 12, 40, 24)
            out["qwen2_vl/video"] = check_pieces(built, "vision", str(video), processor="video")
        if family == "llava":
            out["llava/vision/frozen"] = check_pieces(built, "vision", raw["image"], frozen=True)
    return out
