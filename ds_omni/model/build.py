"""ModelConfig -> a ready OmniModel with its tokenizer and item processors.

A model comes from an HF MLLM directory (`model.pretrained`, loaded through the family's real
`from_pretrained`) or is composed from parts (`model.llm` + `model.vision`/`model.audio`, see
`compose.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_omni.config import ModelConfig
from ds_omni.data import demo
from ds_omni.errors import ModelError
from ds_omni.model.attention import PackedAttention
from ds_omni.model.family import Family, ItemProcessor, family_for
from ds_omni.model.omni import OmniModel


@dataclass
class BuiltModel:
    model: OmniModel
    tokenizer: object
    family: Family
    hf_config: object
    item_processors: dict[str, ItemProcessor]
    model_dir: Path | None


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
    model_type = json.loads(config_file.read_text()).get("model_type")
    if not model_type:
        raise ModelError(f"{config_file} has no 'model_type'")
    return model_type


def check_weights_present(model_dir: Path) -> None:
    if not any(model_dir.glob("*.safetensors")):
        raise ModelError(f"no safetensors weights in {str(model_dir)!r} (found "
                         f"{sorted(p.name for p in model_dir.iterdir())}); ds_omni loads weights only "
                         "from safetensors. Re-save the model with save_pretrained(safe_serialization=True)")


def _load_pretrained(family: Family, model_dir: Path, trust_remote_code: bool):
    """The HF model of an HF directory, or of an OmniModel directory (see convert.save_omni)."""
    from ds_omni.model.convert import is_omni_dir, load_omni_dir
    if is_omni_dir(model_dir):
        return load_omni_dir(model_dir)[0].hf_model
    return family.load_hf(model_dir, trust_remote_code)


def build_model(cfg: ModelConfig) -> BuiltModel:
    """Load or compose the model described by `cfg`, freeze what it names, cast to its dtype."""
    torch.manual_seed(cfg.seed)
    if cfg.pretrained:
        model_dir = Path(cfg.pretrained)
        family = family_for(read_model_type(model_dir))
        check_weights_present(model_dir)
        tokenizer = load_tokenizer(cfg.tokenizer or str(model_dir), cfg.trust_remote_code)
        hf_model = _load_pretrained(family, model_dir, cfg.trust_remote_code)
        check_vocab_fits(tokenizer, hf_model.get_input_embeddings().num_embeddings,
                         f"the model in {str(model_dir)!r}")
    else:
        from ds_omni.model.compose import compose
        model_dir = None
        tokenizer = load_tokenizer(cfg.tokenizer or cfg.llm.pretrained or "", cfg.trust_remote_code)
        family, hf_model = compose(cfg, tokenizer)
    model = family.to_omni(hf_model, tokenizer)
    if cfg.lora is not None:  # the adapters' init draws from the seeded global generator
        from ds_omni.model.lora import apply_lora
        model = apply_lora(model, cfg.lora, tokenizer)
    # the LLM's attention kernel, a model option (its SP group is the plan's: ds_omni.parallelize)
    model.backbone.attention = PackedAttention(cfg.attn_implementation)
    asked = cfg.activation_checkpointing
    model.set_checkpointing(cfg.checkpointed_parts(),
                            named=set() if isinstance(asked, bool) else set(asked) - {"encoders"})
    model.freeze(cfg.freeze)
    model.to(getattr(torch, cfg.dtype))
    processors = family.item_processors(hf_model.config, model_dir, tokenizer=tokenizer)
    return BuiltModel(model=model, tokenizer=tokenizer, family=family, hf_config=hf_model.config,
                      item_processors=processors, model_dir=model_dir)


def llm_text_config(cfg: ModelConfig):
    """(family, the LLM's HF config), read from config files alone, before any model is built."""
    from transformers import AutoConfig
    import ds_omni.model.families  # noqa: F401  (registers the composed model type)
    if cfg.pretrained:
        model_dir = Path(cfg.pretrained)
        family = family_for(read_model_type(model_dir))
        hf = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=cfg.trust_remote_code)
        return family, hf.get_text_config()
    # a vision-only composition with the mlp2x_gelu projector is built as LLaVA (compose.compose)
    llava = cfg.audio is None and cfg.projector == "mlp2x_gelu"
    family = family_for("llava" if llava else "ds_omni_composed")
    part = cfg.llm
    if part.config is not None:
        fields = dict(part.config)
        return family, AutoConfig.for_model(fields.pop("model_type"), **fields)
    return family, AutoConfig.from_pretrained(part.pretrained, trust_remote_code=cfg.trust_remote_code)


def check_sequence_parallel(cfg: ModelConfig, sp: int) -> None:
    """The LLM can run Ulysses SP of degree `sp`: its family supports it and sp divides its heads.

    KV heads need not divide: the kernel repeats them (`repeat_kv_for_sp`), which only needs sp to
    divide the query heads.
    """
    family, text = llm_text_config(cfg)
    if not family.sequence_parallel:
        raise ModelError(f"parallel.sp={sp}: the {family.name!r} family does not support sequence "
                         "parallelism yet; set parallel.sp to 1")
    from ds_omni.model.per_sample import per_sample_types, sp_problem
    problem = sp_problem(per_sample_types(text))
    if problem is not None:
        raise ModelError(f"parallel.sp={sp}: {problem}")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % sp:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        where = f"the LLM of {cfg.pretrained!r}" if cfg.pretrained else "model.llm"
        raise ModelError(f"parallel.sp={sp} must divide the LLM's attention heads: {where} "
                         f"({text.model_type}) has {heads} query heads and {kv_heads} key/value "
                         f"heads; Ulysses splits the heads over the sp ranks, so sp can be one of "
                         f"{ok}")
