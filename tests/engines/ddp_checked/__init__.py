"""A throwaway engine kept outside vit/ (tests/test_engine_seam.py): DDP that all-reduces a checksum
of its weights every --check-every steps and stops the run when the ranks' differ. This folder and
VIT_ENGINES=ddp_checked (with tests/engines on PYTHONPATH) are all it takes: its spec (DDP's, with
one option group of its own), its options (options.py) and its engine (engine.py)."""

from ddp_checked.options import CheckSettings
from vit.engines.ddp import DDPSpec


class CheckedSpec(DDPSpec):
    option_groups = {
        **DDPSpec.option_groups,
        "checked": (CheckSettings, "weight checks (--engine ddp-checked)"),
    }


SPEC = CheckedSpec(
    "ddp-checked",
    "ddp_checked.engine",
    zero_stages=(0,),
    fp16=True,
    default_ds_config="zero0.json",
    comm_hooks=True,
)
