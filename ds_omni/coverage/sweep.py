"""Which transformers vision-language families ds_omni trains exactly: the coverage sweep.

For every model type in transformers' `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`: a type whose
classes or config rule the generic adapter out gets that reason; a type with a tiny recipe
(`ds_omni.coverage.recipes`) is built at random from its config class (hidden 32, two or more LLM
layers, GQA where the family has it, tiny images; no hub; a weight matrix HF starts at zeros
filled at random, `unzero_matrices`), saved with its processor, loaded through `build_model`
(the real loading path), and checked:
- one packed row of the `SWEEP_SAMPLES` conversations (images at the start, middle and end of a
  prompt; a text-only sample) against the HF model run one sample at a time on HF's processor
  output for the whole rendered sample, with a loss mask found in the rendered text
  (`reference`, apart from ds_omni's templates and masks): the same token ids, logits
  within 1e-5 (fp32), the same loss and every trainable parameter's gradient;
- the export round trip: `export_hf` then plain `from_pretrained` gives bitwise-equal tensors.
A type without a recipe is reported unverified. `ds-omni families` prints this same table.
"""

from __future__ import annotations

import inspect
import io
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ds_omni.coverage.torchvision_rows import missing_reason, needs_torchvision
from ds_omni.coverage.recipes import (  # noqa: F401  (RECIPES: also read as sweep.RECIPES)
    NO_RECIPE, NOT_EXACT, RECIPES, config_for, processor_class_for)

LOGITS_ATOL = 1e-5


@dataclass
class Result:
    supported: bool
    reason: str
    needs_torchvision: bool = False
    """The recipe failed here for want of torchvision (the sweep's child may check it)."""

    def as_dict(self) -> dict:
        return {"supported": self.supported, "reason": self.reason}


# ------------------------------------------------------------------------------ checks
def images() -> list:
    """Three demo pictures at different sizes (32x32, 56 high x 84 wide, 24 x 40)."""
    from PIL import Image
    from ds_omni.data.demo import shapes_rows
    rows = shapes_rows(3, seed=5)
    img = [Image.open(io.BytesIO(r["image"]["bytes"])).convert("RGB") for r in rows]
    return [img[0], img[1].resize((84, 56)), img[2].resize((40, 24))]


def save_processor_parts(processor, out: Path) -> None:
    """Tokenizer, image processor and the processor's own settings, as `save_pretrained` writes
    them for a processor with all its parts."""
    import json
    processor.tokenizer.save_pretrained(str(out))
    settings = {k: v for k, v in processor.to_dict().items()
                if k not in processor.get_attributes() and k != "chat_template"}
    settings["image_processor"] = json.loads(processor.image_processor.to_json_string())
    (out / "processor_config.json").write_text(json.dumps(settings, indent=1, default=str))


def check_family(model_type: str, recipe: Callable, work: Path) -> Result:
    """Build, convert and compare one family (module docstring); the result says what failed."""
    from ds_omni.config import ModelConfig
    from ds_omni.model.build import build_model
    torch.manual_seed(0)
    config, processor = recipe()
    from ds_omni.coverage.reference import TEMPLATE
    processor.tokenizer.chat_template = TEMPLATE  # ds_omni renders it as a model's template
    family_dir = work / model_type
    from ds_omni.model.families import family_for
    hf_model = family_for(model_type).build_hf(config).eval()
    unzero_matrices(hf_model)
    hf_model.save_pretrained(str(family_dir), safe_serialization=True)
    save_processor_parts(processor, family_dir)
    built = build_model(ModelConfig(pretrained=str(family_dir)))
    reference = hf_model  # what was saved, bit for bit (a reload would cost a third of the check)
    problem, worst = compare_with_hf(built, reference, processor)
    if problem:
        return Result(False, problem)
    from ds_omni.model.convert import export_hf
    export_hf(built.model, work / f"{model_type}_export", built.tokenizer, model_dir=family_dir)
    exported = type(hf_model).from_pretrained(str(work / f"{model_type}_export"))
    ref, exp = reference.state_dict(), exported.state_dict()
    bad = [k for k in ref if k not in exp or not torch.equal(ref[k], exp[k])]
    if bad or ref.keys() != exp.keys():
        return Result(False, f"export round trip changes {bad[:3] or 'the keys'}")
    return Result(True, f"exact (max |logits diff| {worst:.1g}, loss and gradients; bitwise "
                        "round trip)")


def unzero_matrices(model: torch.nn.Module, std: float = 0.02) -> list[str]:
    """Gives each trainable parameter of two or more dims that HF initialises to all zeros random
    values (normal, `std`: HF's usual initializer_range; a generator of its own, seed 0); returns
    their names.

    A zero matrix blinds the check to what passes through it. Gemma 3 initialises its projector
    (`mm_input_projection_weight`) to zeros: every image embedding is then zero, so the logits
    do not see the images, the vision tower gets no gradient, and the projector's own gradient
    comes through the LLM's RMSNorm of a zero vector (a factor 1/sqrt(eps), 1e3): about 2e5,
    where fp32 rounding alone moves it by 0.08 from fp64's (HF's side as ds_omni's), more than
    the gradient tolerance on its small elements. Trade-off: vectors (biases, norm weights) keep
    HF's zeros: they pass on what they act on, and changing them would change every family."""
    gen = torch.Generator().manual_seed(0)
    names = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and p.dim() >= 2 and not p.any():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
                names.append(name)
    return names


SWEEP_SAMPLES = {
    "start": ([{"from": "human", "value": "<image><image> which is larger?"},
               {"from": "gpt", "value": "the first one"}], [0, 2]),
    "text": ([{"from": "human", "value": "say something"},
              {"from": "gpt", "value": "a caption without an image"}], []),
    "middle": ([{"from": "human", "value": "compare <image> and <image>"},
                {"from": "gpt", "value": "a wide one and a small one"}], [1, 2]),
}
"""id -> (conversation, indices into `images()`): images at the start of a sample (adjacent), in
its middle and at the end of its prompt, with text before and between; and a text-only sample."""


def sweep_samples(built) -> tuple[list, dict]:
    """The sweep's samples (`SWEEP_SAMPLES`) as the built model's processors make them, and each
    one's (conversation, images) by sample id."""
    from ds_omni.data.processing import SampleProcessor
    img = images()
    cases = {k: (turns, [img[i] for i in at]) for k, (turns, at) in SWEEP_SAMPLES.items()}
    proc = SampleProcessor(tokenizer=built.tokenizer, family=built.family,
                           item_processors=built.item_processors, markers={"vision": "<image>"},
                           max_seq_len=4096)
    samples = [proc(text=turns, media={"vision": imgs} if imgs else {}, sample_id=k,
                    source="sweep") for k, (turns, imgs) in cases.items()]
    return samples, cases


def compare_with_hf(built, reference, processor) -> tuple[str | None, float]:
    """(what differs, max |logits diff|) between one packed row of the sweep's samples through
    ds_omni and HF's model run one sample at a time on what HF's processor makes of each
    rendered sample, with a loss mask found in the rendered text (`reference`): logits
    (<= LOGITS_ATOL), the mean token loss, and every trainable parameter's gradient."""
    from ds_omni.data.packing import pack
    from ds_omni.coverage import reference as oracle
    samples, cases = sweep_samples(built)
    reference.zero_grad(set_to_none=True)
    ref_sum, ref_count, worst, ref_logits = 0.0, 0, 0.0, []
    for s in samples:
        inputs, mask = hf_side(processor, built, *cases[s.sample_id])
        ids = inputs["input_ids"][0]
        if not torch.equal(ids, s.input_ids):
            return (f"sample {s.sample_id!r}: HF's processor gives other tokens than ds_omni: "
                    f"{built.tokenizer.decode(ids)[:160]!r} vs "
                    f"{built.tokenizer.decode(s.input_ids)[:160]!r}"), 0.0
        logits = reference(**inputs).logits[0]
        loss, count = oracle.hf_loss(logits, ids, mask)
        ref_sum, ref_count = ref_sum + loss, ref_count + count
        ref_logits.append(logits.detach())
    (ref_sum / ref_count).backward()
    model = built.model
    model.zero_grad(set_to_none=True)
    mb = pack(samples, built.item_processors)
    out = model(mb)
    (out.loss_sum / out.num_targets).backward()
    with torch.no_grad():
        ours = model.logits(mb)[0]
    cu = mb.cu_seqlens.tolist()
    for ref, a, b in zip(ref_logits, cu[:-1], cu[1:]):
        worst = max(worst, (ref - ours[a:b]).abs().max().item())
    if worst > LOGITS_ATOL:
        return f"logits differ from HF by {worst:.2g} (> {LOGITS_ATOL})", worst
    if int(out.num_targets) != ref_count:
        return (f"ds_omni trains {int(out.num_targets)} tokens, the assistant spans of the "
                f"rendered samples hold {ref_count}"), worst
    loss = (out.loss_sum / out.num_targets).item()
    want = (ref_sum / ref_count).item()
    if abs(loss - want) > oracle.LOSS_RTOL * abs(want) + 1e-7:
        return f"loss {loss:.8g} differs from HF's {want:.8g}", worst
    bad, checked = oracle.grad_problems(  # tied weights: each under every name
        reference, dict(model.named_parameters(remove_duplicate=False)), model.hf_key_map())
    if bad or not checked:
        return f"gradients differ from HF: {'; '.join(bad[:3]) or 'none compared'}", worst
    return None, worst


def hf_side(processor, built, turns, imgs) -> tuple[dict, torch.Tensor]:
    """(HF model inputs, [L] loss mask) for a conversation: rendered in the plain format, its
    images written as the processor expects them, the whole text and its images given to HF's
    processor in one call; the mask from the rendered text's assistant spans."""
    from ds_omni.coverage import reference as oracle
    from ds_omni.model.families.hf_processor import processor_call, processor_marker
    marker = processor_marker(processor, built.hf_config) if imgs else "<image>"
    if imgs and marker == "":
        raise AssertionError("the processor writes the image tokens itself (one image a text, "
                             "first): it cannot place images inside a sample's text")
    text, spans = oracle.render(turns, built.tokenizer, image_text=marker, templated=True)
    if imgs:
        hf = processor_call(processor, [text], imgs)
    else:
        hf = dict(processor.tokenizer([text], add_special_tokens=False, return_tensors="pt"))
    ids = hf["input_ids"]
    mask = oracle.token_mask(ids[0].tolist(), text, spans, built.tokenizer, (marker,))
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    out.update({k: v for k, v in hf.items() if k not in (
        "input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "labels")})
    out.update(token_types(processor, built, ids, mask))
    return out, mask


def token_types(processor, built, ids: torch.Tensor, trained: torch.Tensor) -> dict:
    """The per-token type ids the family's forward reads, as HF's processor makes them."""
    forward = inspect.signature(built.family.hf_model_class().forward).parameters
    make_types = getattr(processor, "create_mm_token_type_ids", None)
    out = {}
    if "token_type_ids" in forward and "mm_token_type_ids" not in forward:
        out["token_type_ids"] = hf_token_types(processor, ids, trained)
    elif make_types is not None and len(inspect.signature(make_types).parameters) == 1:
        out["mm_token_type_ids"] = torch.tensor(processor.create_mm_token_type_ids(ids.tolist()))
    if "moe_mm_token_type_ids" in forward:  # ERNIE-4.5-VL's MoE routing by modality
        out["moe_mm_token_type_ids"] = torch.tensor(
            processor.create_moe_mm_token_type_ids(ids.tolist()))
    return out


def hf_inputs(processor, built, sample, imgs) -> dict:
    """What HF's processor gives the model for ds_omni's `sample`: its pixels (all the sample's
    images in one call), and its per-token type ids; the token ids are the sample's, whose image
    tokens must number what HF's processor expands them to (`test_per_sample`'s reference; the
    sweep's is `hf_side`, HF's tokens of the whole rendered sample)."""
    from ds_omni.model.families.generic import image_token_id
    from ds_omni.model.families.hf_processor import processor_call, processor_marker
    ids = sample.input_ids[None]
    # the processor's attention mask too: without one, some families (Qwen2.5-Omni's thinker)
    # silently fall back to 1-D positions
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if imgs:
        marker = processor_marker(processor, built.hf_config)
        # a processor that writes the image token itself (marker "") takes one image per text
        # (Fuyu's): one call per image, their pixels concatenated as its batch path does
        calls = [[img] for img in imgs] if marker == "" else [imgs]
        hf = [processor_call(processor, [marker * len(c)], c) for c in calls]
        token = image_token_id(built.hf_config)
        if sum(int((h["input_ids"] == token).sum()) for h in hf) != int((ids == token).sum()):
            raise AssertionError("HF's processor expands the images to another number of tokens")
        out.update({k: hf[0][k] if len(hf) == 1 else torch.cat([h[k] for h in hf]) for k in hf[0]
                    if k not in ("input_ids", "attention_mask", "token_type_ids",
                                 "mm_token_type_ids", "labels")})
    out.update(token_types(processor, built, ids, sample.loss_mask))
    return out


def hf_token_types(processor, ids: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """[1, L] `token_type_ids` as HF's processor makes them for a family whose attention mask
    reads them: PaliGemma's 1 on the suffix (its `suffix` argument: the text from the first trained
    token on), the others' (Gemma 3) 1 on image tokens."""
    if type(processor).__name__.startswith("PaliGemma"):
        trained = trained.nonzero()
        types = torch.zeros_like(ids)
        types[:, int(trained[0]) if len(trained) else ids.shape[1]:] = 1
        return types
    return torch.tensor(processor.create_mm_token_type_ids(ids.tolist()))


# ------------------------------------------------------------------------------ sweep
def sweep(model_types: list[str] | None = None) -> dict[str, Result]:
    """{model_type: Result} for every type of the mapping (or those given), in mapping order.

    The types whose recipe needs torchvision, when this process has none, go to one child process
    (`torchvision_rows`): at once those whose image processor is torchvision-only, the others when
    their recipe fails here for want of it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    types = model_types or list(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    out, threads = {}, torch.get_num_threads()
    apart = TorchvisionRows(types)
    # one thread: the tiny models' matmuls gain nothing from more, and on a busy machine a second
    # OpenMP thread makes each of them wait (measured 30x slower at load 12 on 2 cores)
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for model_type in types:
                out[model_type] = apart.result(model_type) or classify(model_type, Path(tmp))
                apart.take_if_wanted(model_type, out[model_type])
    finally:
        torch.set_num_threads(threads)
    out.update(apart.results())
    return out


class TorchvisionRows:
    """The rows of a sweep that need torchvision where this process has none (module
    `torchvision_rows`): a child process is started at once with the types whose image processor
    is torchvision-only, and takes the others whose recipe fails here for want of it."""

    def __init__(self, types: list[str]):
        from ds_omni.coverage import torchvision_rows
        self.path = (None if torchvision_rows.importable_here()
                     else torchvision_rows.torchvision_dir())
        self.child = None
        self.early = [t for t in types if self.path and t in RECIPES and t not in NOT_EXACT
                      and image_processor_problem(t)]
        for t in self.early:
            self.send(t)

    def send(self, model_type: str) -> None:
        from ds_omni.coverage.torchvision_rows import Child
        self.child = self.child or Child(self.path)
        self.child.send(model_type)

    def result(self, model_type: str) -> Result | None:
        """A placeholder row for a type the child checks (its answer comes in `results`)."""
        return Result(False, "checked in the child") if model_type in self.early else None

    def take_if_wanted(self, model_type: str, result: Result) -> None:
        if self.path and result.needs_torchvision:
            self.send(model_type)

    def results(self) -> dict[str, Result]:
        if self.child is None:
            return {}
        return {t: Result(**r) for t, r in self.child.results().items()}


def static_problem(model_type: str) -> str | None:
    """Why the generic adapter refuses `model_type`, from its classes and its default config."""
    from ds_omni.model.families.generic import class_problem, config_problem
    problem = class_problem(model_type) or processor_problem(model_type)
    if problem is not None:
        return problem
    try:
        problem = config_problem(config_for(model_type))
    except Exception as e:  # noqa: BLE001  (a config class that cannot build its own defaults)
        return f"its default config does not build ({type(e).__name__})"
    return problem or image_processor_problem(model_type)


def processor_problem(model_type: str) -> str | None:
    """Why HF's processor of `model_type` (which the generic adapter cuts images with) is not at
    hand, or None."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from ds_omni.model.families.hf_processor import processor_type
    name = PROCESSOR_MAPPING_NAMES.get(processor_type(model_type))
    if name is None:
        return "transformers maps no processor to it, so nothing says how its images become tokens"
    try:
        processor_class_for(model_type).get_attributes()  # a placeholder class raises here
    except ImportError as e:
        needs = [w.strip(".,`") for w in str(e).split() if w.lower() in (
            "torchvision", "timm", "num2words", "librosa")]
        return f"HF's {name} needs {needs[0] if needs else 'a package'} (not installed here)"
    return None


def image_processor_problem(model_type: str) -> str | None:
    """Why HF's image processor of `model_type` is not at hand without torchvision, or None."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.utils import is_torchvision_available
    from ds_omni.model.families.hf_processor import processor_type
    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(processor_type(model_type))
    if isinstance(names, dict) and names and "pil" not in names and (
            not is_torchvision_available()):
        return (f"HF's image processor for it ({next(iter(names.values()))}) is torchvision-only, "
                "and the PyPI torchvision wheel (a CUDA build) does not load next to a CPU torch")
    return None


def classify(model_type: str, work: Path) -> Result:
    """The table row of `model_type`: checked exact by its recipe, or why not."""
    recipe = RECIPES.get(model_type)
    if model_type in NOT_EXACT:
        return Result(False, NOT_EXACT[model_type])
    if recipe is None:
        problem = static_problem(model_type)
        if problem is not None:
            return Result(False, problem)
        return Result(False, NO_RECIPE.get(model_type, "not verified: the sweep has no tiny recipe "
                                           "for it yet (the generic adapter loads it; exactness "
                                           "unchecked)"))
    try:
        return check_family(model_type, recipe, work)
    except Exception as e:  # noqa: BLE001  (every failure is a row of the table)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if needs_torchvision(e):
            return Result(False, static_problem(model_type) or missing_reason(first), True)
        return Result(False, f"{type(e).__name__}: {first[:300]}")


def table(results: dict[str, Result]) -> str:
    width = max(map(len, results), default=10)
    lines = [f"{'model_type':{width}}  supported  reason"]
    lines += [f"{t:{width}}  {'yes' if r.supported else 'no':9}  {r.reason}"
              for t, r in results.items()]
    done = sum(r.supported for r in results.values())
    lines.append(f"{done} of {len(results)} supported ({100 * done / max(len(results), 1):.0f} %)")
    return "\n".join(lines)
