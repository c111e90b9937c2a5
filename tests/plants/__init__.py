"""Planted errors, one module per area (the launches or layers each breaks), all in one registry
(`registry.py`: how a plant is written, applied and found by its launch).

    from tests import plants
    with plants.applied("loss_x2", rank): ...
    plants.for_launch("dp")  # the plants a launch's `test_plant_*` must catch
"""

from tests.plants import (bf16, checkpoint, context_parallel, data, expert_parallel,  # noqa: F401  (register)
                          parity, pipeline, sequence_parallel, sim, tensor_parallel, train)
from tests.plants.registry import PLANTS, Plant, applied, for_launch, plant  # noqa: F401
