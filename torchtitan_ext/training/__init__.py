"""Training: torchtitan's trainer with our specs, loss, metrics and fault handling.

Owns: the trainer and a job's run (:mod:`.trainer`), the train specs that
bind models, loss and metrics (:mod:`.specs`), the pipeline loss
(:mod:`.loss`), step metrics (:mod:`.metrics`), validation (:mod:`.validator`), preemption, non-finite steps
and torn checkpoints with their ``[faults]`` section (:mod:`.faults`), and
:func:`prepare`, which readies a process to read and run jobs.

May import: every tier below it: :mod:`torchtitan_ext.config`,
:mod:`~torchtitan_ext.runtime`, :mod:`~torchtitan_ext.ep`,
:mod:`~torchtitan_ext.data`, :mod:`~torchtitan_ext.models`,
:mod:`~torchtitan_ext.balancing` (see the tiers in :mod:`torchtitan_ext`).
"""

# imported lowest tier first: each registers its sections, and its checks run in this order
import torchtitan_ext.ep  # noqa: F401  (each backend's section and checks)
from torchtitan_ext.data import register_embedded_dataset  # (the dataset options check)
import torchtitan_ext.balancing  # noqa: F401  ([routing_stats], [expert_placement] and its check)
import torchtitan_ext.models.converters  # noqa: F401  (the low-precision converters and their check)
from torchtitan_ext import runtime
from torchtitan_ext.training import checkpoints, faults, nvlink_domains, validator  # noqa: F401  ([faults], [fabric], checks)
from torchtitan_ext.training.specs import register_train_specs


def prepare() -> str:
    """Ready this process to read and run jobs; returns its device type ("cuda" or "cpu").

    Applies the device's accommodations (:func:`torchtitan_ext.runtime.configure`),
    registers the embedded dataset and our train specs; importing this package
    has registered every feature's config section and checks. Idempotent.
    """
    device_type = runtime.configure()
    register_embedded_dataset()
    register_train_specs()
    return device_type
