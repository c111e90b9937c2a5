"""The device path: precision of encoder inputs, the process-group backend and device, and a
forward that never waits for the device (checked on the meta device, where any read of a device
value fails)."""

import numpy as np
import pytest
import torch

from ds_omni.config import ModelConfig, PartConfig
from ds_omni.data.packing import pack
from ds_omni.errors import LaunchError
from ds_omni.model.build import build_model
from ds_omni.parallel.dist import backend_for, local_device_index
from tests.family_checks import processor_for
from tests.fixtures import TINY_LLAMA, TINY_VISION



def _built(dtype="float32"):
    return build_model(ModelConfig(tokenizer="builtin:shapes", vision=PartConfig(config=TINY_VISION),
                                   llm=PartConfig(config=TINY_LLAMA), dtype=dtype))


def _batch(built, with_image=True):
    from PIL import Image
    proc = processor_for(built)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    samples = [proc(text="plain text only", media={}, sample_id="b", source="t")]
    if with_image:
        samples.insert(0, proc(text=[{"from": "human", "value": "<image> what?"},
                                     {"from": "gpt", "value": "a red disc"}],
                               media={"vision": [image]}, sample_id="a", source="t"))
    return pack(samples, built.item_processors)


def test_bf16_model_gets_encoder_inputs_in_its_dtype():
    """The loader's pixel values are fp32; a bf16 tower receives them as bf16 (also its dummy)."""
    built = _built("bfloat16")
    seen = []
    patch = built.model.encoders["vision"].tower.embeddings.patch_embedding
    patch.register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))
    for with_image in (True, False):  # a real image, then the zero-weight dummy pass
        mb = _batch(built, with_image)
        assert all(v.dtype == torch.float32 for v in mb.encoder_inputs.get("vision", {}).values())
        out = built.model(mb.to("cpu"))
        out.loss_sum.backward()
        assert out.loss_sum.dtype == torch.float32 and torch.isfinite(out.loss_sum)
    assert seen == [torch.bfloat16, torch.bfloat16]


@pytest.mark.parametrize("with_image", [True, False])
def test_forward_reads_no_value_from_the_device(with_image):
    """On the meta device any `.item()`, `int(t.sum())`, `.tolist()` or boolean-mask index of a
    device tensor raises: the forward passes only because shapes and positions come from the
    host batch (one micro-batch, one packed row)."""
    built = _built()
    mb = _batch(built, with_image)
    built.model.to("meta")
    out = built.model(mb.to("meta"))
    assert out.loss_sum.device.type == "meta"
    assert out.num_targets == mb.num_targets > 0


def test_moved_batch_finds_positions_on_the_host():
    built = _built()
    mb = _batch(built)
    moved = mb.to("meta")
    image_id = built.model.encoders["vision"].placeholder_id
    assert moved.host is mb and moved.to("meta").host is mb
    expected = (mb.input_ids[0] == image_id).nonzero().squeeze(1)
    assert moved.positions_of(image_id).device.type == "meta"
    torch.testing.assert_close(mb.positions_of(image_id), expected)
    assert moved.positions_of(image_id).shape == expected.shape
    assert moved.num_targets == mb.num_targets == int((mb.targets != -100).sum())


def test_backend_is_nccl_on_gpus_and_gloo_on_cpu():
    assert backend_for("cuda", "nccl") == "nccl" and backend_for("cpu", "ccl") == "gloo"
    assert backend_for("xpu", "ccl") == "ccl"  # other accelerators: DeepSpeed's own choice
    from deepspeed.accelerator import get_accelerator
    accel = get_accelerator()  # this machine, without any user setting
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert backend_for(accel.device_name(), accel.communication_backend_name()) == expected


def test_each_rank_takes_its_own_gpu():
    assert local_device_index("cuda", 3, 8) == 3
    with pytest.raises(LaunchError, match=r"LOCAL_RANK=8 but this node has 8 cuda device\(s\) "
                                          r"visible; start at most 8 processes per node"):
        local_device_index("cuda", 8, 8)
