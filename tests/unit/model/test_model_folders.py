"""Model folders as users bring them: a missing or empty tokenizer, a tokenizer larger than the
model's vocabulary, a model type ds_omni has no adapter for. Each is a ModelError that names the
folder and the fix, before any training step."""

import json
import shutil

import pytest

from ds_omni.errors import ModelError
from tests.family_checks import load_omni
from tests.family_dirs import make_llava_dir, make_qwen2_vl_dir, qwen_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _without_tokenizer(src, dst):
    shutil.copytree(src, dst)
    for name in TOKENIZER_FILES:
        (dst / name).unlink(missing_ok=True)
    return dst


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_llava_dir(tmp_path_factory.mktemp("llava"))


def test_folder_from_which_transformers_builds_an_empty_tokenizer(tmp_path):
    """For Qwen2 model types AutoTokenizer builds a tokenizer with no vocabulary from a folder
    without tokenizer files; every caption would tokenise to nothing."""
    bare = _without_tokenizer(make_qwen2_vl_dir(tmp_path / "qwen"), tmp_path / "bare")
    with pytest.raises(ModelError, match=r"no usable tokenizer in '.*bare'.* into nothing.*"
                                         r"set model\.tokenizer"):
        load_omni(bare)


def test_folder_without_tokenizer_files(llava_dir, tmp_path):
    bare = _without_tokenizer(llava_dir, tmp_path / "bare")
    with pytest.raises(ModelError, match=r"no usable tokenizer in '.*bare'.*Couldn't instantiate "
                                         r"the backend tokenizer.*set model\.tokenizer"):
        load_omni(bare)
    assert load_omni(bare, tokenizer=str(llava_dir)).tokenizer is not None  # the fix it names


def test_tokenizer_larger_than_the_models_vocabulary(llava_dir, tmp_path):
    """Ids past the embedding table would raise an IndexError inside F.embedding at step 0."""
    bigger = tmp_path / "bigger_tokenizer"
    qwen_tokenizer().save_pretrained(str(bigger))  # the model's tokenizer plus 4 tokens
    with pytest.raises(ModelError, match=r"the tokenizer has \d+ tokens but the model in "
                                         r"'.*llava.*' has only \d+ token embeddings"):
        load_omni(llava_dir, tokenizer=str(bigger))


def test_unknown_family_names_the_families_and_composing(tmp_path):
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "blip_2"}))
    with pytest.raises(ModelError) as err:
        load_omni(odd)
    message = str(err.value)
    assert "unknown model family: model_type 'blip_2'" in message
    assert "llava_next, " in message and "composed (model_type 'ds_omni_composed')" in message
    assert "compose one from parts" in message and "model.llm" in message
    assert "model.vision" in message and "model.audio" in message
