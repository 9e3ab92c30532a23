"""z-lab's DFlash2 block-diffusion drafter: config, module and checkpoint loader."""

from .config import FULL_LAYER, SLIDING_LAYER, DFlashConfig, default_target_layer_ids
from .drafter import DFlashDrafter
from .weights import DFlashWeightsError, check_shapes, expected_shapes, load_drafter

__all__ = ["FULL_LAYER", "SLIDING_LAYER", "DFlashConfig", "DFlashDrafter", "DFlashWeightsError", "check_shapes",
           "default_target_layer_ids", "expected_shapes", "load_drafter"]
