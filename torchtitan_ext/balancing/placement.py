"""Expert placement: which physical slot holds each logical expert, and the file that says so.

Under expert parallelism EP rank r holds the physical slots r*m .. r*m+m-1
(m = experts / EP). A :class:`Placement` maps every MoE layer's logical experts
(the router's ids) onto those slots; ``[expert_placement] file`` trains with one
(:mod:`.migration` moves the weights), and ``python -m torchtitan_ext.placement``
makes one from recorded routing (:mod:`.placement_search`).

The file (JSON), as training's ``[expert_placement] file`` reads it::

    {"num_experts": 8, "expert_parallel_degree": 4,
     "layers": {"1": [3, 0, 5, 7, 1, 2, 6, 4], ...}}

``layers[L][s]`` is the logical expert in physical slot s of MoE layer L: every
MoE layer of the model, each a permutation of 0 .. experts-1.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from torchtitan_ext.config import ConfigError, moe_layer_ids, register_check, register_section, ValidationContext


@dataclass
class ExpertPlacement:
    file: str = ""
    """
    Placement file (JSON, made by ``python -m torchtitan_ext.placement``): the
    physical slot of every MoE layer's logical experts. Empty: expert e in
    slot e. Needs expert_parallel_degree > 1, the EP degree and the model the
    file was made for. Routers keep logical ids and a logical-to-slot map sends
    tokens to slots; at start or resume the expert weights and their optimizer
    state move to their slots, and checkpoints record the placement they hold,
    so a checkpoint resumes under any placement (or none).
    """


register_section("expert_placement", ExpertPlacement)


@dataclass(frozen=True)
class Placement:
    """Logical expert per physical slot, for every MoE layer."""

    num_experts: int
    expert_parallel_degree: int
    layers: dict[int, tuple[int, ...]]
    """MoE layer id -> the logical expert in each physical slot."""

    @classmethod
    def identity(cls, layers, num_experts: int, expert_parallel_degree: int) -> "Placement":
        return cls(num_experts, expert_parallel_degree, {layer: tuple(range(num_experts)) for layer in layers})

    def is_identity(self) -> bool:
        return all(slots == tuple(range(self.num_experts)) for slots in self.layers.values())

    def to_json(self) -> str:
        return json.dumps({
            "num_experts": self.num_experts,
            "expert_parallel_degree": self.expert_parallel_degree,
            "layers": {str(layer): list(slots) for layer, slots in sorted(self.layers.items())},
        })

    def check_job(self, moe_layers, num_experts: int, expert_parallel_degree: int, where: str) -> None:
        """ConfigError unless this placement fits the model's MoE layers and the job's EP degree."""
        if self.num_experts != num_experts:
            raise ConfigError(
                f"{where}: placement for {self.num_experts} experts but the model has {num_experts}: "
                "make the placement for this model (python -m torchtitan_ext.placement)"
            )
        if set(self.layers) != set(moe_layers):
            raise ConfigError(
                f"{where}: placement layers {sorted(self.layers)} are not the model's MoE layers "
                f"{sorted(moe_layers)}: make the placement for this model"
            )
        if expert_parallel_degree == 1:
            raise ConfigError(
                f"{where}: a placement needs expert parallelism, but parallelism.expert_parallel_degree = 1: "
                "remove [expert_placement] file or set expert_parallel_degree > 1"
            )
        if self.expert_parallel_degree != expert_parallel_degree:
            raise ConfigError(
                f"{where}: placement made for expert_parallel_degree = {self.expert_parallel_degree} but the job "
                f"runs {expert_parallel_degree}: make it for this EP degree (python -m torchtitan_ext.placement)"
            )


def load_placement(path: str) -> Placement:
    """A placement file; ConfigError naming the problem (the file's own consistency: not the job's)."""
    where = f"expert_placement.file = '{path}'"
    remake = "make it with python -m torchtitan_ext.placement"
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist: make one with python -m torchtitan_ext.placement") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"{where} is not a JSON placement file ({type(e).__name__}: {e}): {remake}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} holds a JSON {type(data).__name__}, not an object with num_experts, "
                          f"expert_parallel_degree and layers: {remake}")
    missing = [key for key in ("num_experts", "expert_parallel_degree", "layers") if key not in data]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}: {remake}")
    experts, ep = data["num_experts"], data["expert_parallel_degree"]
    if not _is_count(experts) or not _is_count(ep) or experts % ep:
        raise ConfigError(f"{where}: num_experts = {experts!r} and expert_parallel_degree = {ep!r} must be positive "
                          "integers, the second dividing the first")
    if not isinstance(data["layers"], dict) or not data["layers"]:
        raise ConfigError(f"{where}: layers must be an object mapping each MoE layer id to its slots, "
                          f"not {json.dumps(data['layers'])[:40]}: {remake}")
    layers = {}
    for key, slots in data["layers"].items():
        if not key.isdigit():
            raise ConfigError(f"{where}: layer id '{key}' is not a model layer number")
        problem = _permutation_problem(slots, experts)
        if problem:
            raise ConfigError(f"{where}: layer {key} is not a permutation of the experts 0..{experts - 1} ({problem})")
        layers[int(key)] = tuple(slots)
    return Placement(experts, ep, layers)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _permutation_problem(slots, experts: int) -> str | None:
    """Why ``slots`` is not a permutation of 0 .. experts-1 (None when it is one)."""
    if not isinstance(slots, list):
        return f"{type(slots).__name__}, not a list"
    if len(slots) != experts:
        return f"{len(slots)} slots for {experts} experts"
    seen = set()
    for value in slots:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < experts:
            return f"{value!r} is not an expert id"
        if value in seen:
            return f"expert {value} appears twice"
        seen.add(value)
    return None


def check_placement_file(job_config, context: ValidationContext) -> None:
    """ConfigError unless ``[expert_placement] file`` is a placement of this model's MoE layers at the job's EP degree."""
    path = job_config.expert_placement.file
    if not path:
        return
    where = f"expert_placement.file = '{path}'"
    shape = context.moe_shape
    if shape is None:
        raise ConfigError(f"{where} but the model has no MoE layers: remove [expert_placement] file")
    load_placement(path).check_job(
        moe_layer_ids(job_config), shape.num_experts, job_config.parallelism.expert_parallel_degree, where
    )


register_check(check_placement_file)
