"""The coverage sweep's torchvision rows (`ds_omni.coverage.torchvision_rows`) and the generic
adapter's pieces they need that the sweep checks only in its torchvision child (there, the sweep's
own `test_family_generic.py` holds them exact)."""

import importlib.util
import sys

import pytest

from ds_omni.coverage import sweep, torchvision_rows
from ds_omni.errors import ModelError
from ds_omni.model.families import hf_processor


def test_torchvision_side_stays_off_the_import_path():
    """Set-up's torchvision (its Python side) is for the sweep's child only: an ordinary process
    neither imports it nor lets transformers take torchvision for available."""
    side = torchvision_rows.torchvision_dir()
    assert side is None or str(side) not in sys.path
    if not torchvision_rows.importable_here():  # no torchvision installed normally
        assert importlib.util.find_spec("torchvision") is None


def test_without_torchvision_rows_say_why(monkeypatch, tmp_path):
    """No torchvision side at hand: no child is started, and the rows say what is missing, for a
    torchvision-only image processor (found from the mappings) and for a recipe that fails here
    for want of torchvision (MiniCPM-V 4.6's processor reads its video processor when built)."""
    monkeypatch.setenv(torchvision_rows.ENV, str(tmp_path))  # an empty folder
    monkeypatch.setattr(torchvision_rows, "Child", None)  # starting one would fail
    if torchvision_rows.importable_here():
        pytest.skip("a real torchvision is installed")
    rows = sweep.sweep(["lfm2_vl", "minicpmv4_6"])
    assert not rows["lfm2_vl"].supported and "torchvision-only" in rows["lfm2_vl"].reason
    assert not rows["minicpmv4_6"].supported
    assert "MiniCPMV4_6VideoProcessor requires the Torchvision" in rows["minicpmv4_6"].reason
    assert "make setup" in rows["minicpmv4_6"].reason


def test_child_answers_are_read_past_noise():
    out = 'a library prints this\n{"x": {"supported": true, "reason": "exact"}}\n\n3\n{"y": 1}\n'
    assert torchvision_rows.parse_answers(out) == {"x": {"supported": True, "reason": "exact"},
                                                   "y": 1}


def test_processor_reading_its_video_processor_needs_torchvision(tmp_path):
    """MiniCPM-V 4.6's processor reads its video processor's settings when it is built, which
    the adapter then builds too; without torchvision that is an error that says what to install
    (HF's own is an AttributeError on None)."""
    import transformers
    assert hf_processor._reads_video_processor(transformers.MiniCPMV4_6Processor)
    assert not hf_processor._reads_video_processor(transformers.Qwen2VLProcessor)
    if torchvision_rows.importable_here():
        return
    with pytest.raises(ModelError, match=r"(?s)MiniCPMV4_6Processor reads its video processor.*"
                                         r"install torchvision"):
        hf_processor._video_processor("minicpmv4_6", transformers.MiniCPMV4_6Processor, {},
                                      tmp_path)


def test_list_inputs_of_get_image_features():
    """Unlimited-OCR's processor hands its tile counts and grids over as lists, which its
    `get_image_features` reads; the adapter carries exactly those (not MiniCPM's `grids`)."""
    import transformers
    assert hf_processor.list_inputs(transformers.UnlimitedOcrProcessor,
                                    transformers.UnlimitedOcrModel) == ("num_local_patches",
                                                                        "patches_grid")
    minicpm = type("P", (), {"skip_tensor_conversion": ["grids", "num_patches_per_image"]})
    assert hf_processor.list_inputs(minicpm, transformers.MiniCPMV4_6Model) == ()


def test_torchvision_only_image_processor_is_a_clear_error(tmp_path):
    """Loading a type whose HF image processor is a torchvision class, without torchvision, says
    what to install (transformers' own placeholder fails deeper)."""
    if torchvision_rows.importable_here():
        pytest.skip("a real torchvision is installed")
    with pytest.raises(ModelError, match=r"Lfm2VlImageProcessor\) exists only as a torchvision "
                                         r"class: install torchvision"):
        hf_processor._pil_image_processor("lfm2_vl", tmp_path)
