"""An HF model directory's parts, read with errors that say what is missing: its model type, its
safetensors weights, and its tokenizer (checked to turn text into known tokens, and to fit the
model's embedding table). `build` and `compose` read the directories they are given through it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ds_omni.data import demo
from ds_omni.errors import ModelError


TOKENIZER_PROBE = "The quick brown fox jumps over the lazy dog: 1, 2, 3."
"""Any usable tokenizer turns this into known tokens; an empty one (a folder without tokenizer
files, from which transformers still builds e.g. a Qwen2 tokenizer) into nothing."""


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer saved in `path`, checked to tokenise text into known tokens.

    transformers does not always fail on a folder without tokenizer files: for some model types
    it builds an empty tokenizer, on which every caption tokenises to nothing and training runs on
    end-of-sequence tokens alone, so the probe below is what catches a missing tokenizer.
    """
    from transformers import AutoTokenizer
    if demo.is_builtin(path):
        path = str(demo.ensure_builtin(path, "tokenizer"))
    if not Path(path).is_dir():
        raise ModelError(f"tokenizer directory {path!r} does not exist; set model.tokenizer to a "
                         "directory written by save_pretrained, or \"builtin:shapes\"")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "backend tokenizer" in first or isinstance(e, OSError):  # no tokenizer files there
            raise ModelError(_no_tokenizer(path, f"transformers cannot build one ({first})")) from None
        raise ModelError(f"cannot load the tokenizer in {path!r}: {first}") from None
    ids = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    if all(i == tokenizer.unk_token_id for i in ids):  # also true of no ids at all
        got = "nothing" if not ids else f"only unknown tokens {ids[:5]}"
        raise ModelError(_no_tokenizer(
            path, f"the {type(tokenizer).__name__} transformers built from it has "
                  f"{len(tokenizer)} tokens and turns text ({TOKENIZER_PROBE!r}) into {got}, so "
                  "training would see no text"))
    return tokenizer


def _no_tokenizer(path: str, why: str) -> str:
    files = sorted(p.name for p in Path(path).iterdir())
    return (f"no usable tokenizer in {path!r}: {why}. The folder holds {files}; a tokenizer is "
            "tokenizer.json (or tokenizer.model, or vocab.json + merges.txt) with "
            "tokenizer_config.json. Copy the tokenizer files of the model it came from into the "
            "folder (tokenizer.save_pretrained), or set model.tokenizer to a directory that has them")


def check_vocab_fits(tokenizer, vocab_size: int, what: str) -> None:
    """Every token id the tokenizer can produce indexes a row of the model's embedding table."""
    if vocab_size < len(tokenizer):
        raise ModelError(f"the tokenizer has {len(tokenizer)} tokens but {what} has only "
                         f"{vocab_size} token embeddings (vocab_size): ids >= {vocab_size} would "
                         "index past its embedding table. Use the model's own tokenizer "
                         "(model.tokenizer) or a model with a larger vocab_size")


def read_model_type(model_dir: Path) -> str:
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{str(model_dir)!r} is not an HF model directory: no config.json. Give a "
                         "directory written by save_pretrained (or by ds-omni convert)")
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{str(config_file)!r} is not valid JSON ({e}); restore it from the "
                         "model's source or save the model again with save_pretrained") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not model_type:
        raise ModelError(f"{str(config_file)!r} has no 'model_type'; give a directory written by "
                         "save_pretrained (its config.json names the architecture)")
    return model_type


def check_weights_present(model_dir: Path) -> None:
    if not any(model_dir.glob("*.safetensors")):
        raise ModelError(f"no safetensors weights in {str(model_dir)!r} (found "
                         f"{sorted(p.name for p in model_dir.iterdir())}); ds_omni loads weights only "
                         "from safetensors. Re-save the model with save_pretrained(safe_serialization=True)")
