"""Expert placement while training: which slot each expert's weights are in, and moving them.

:class:`ExpertMigration` records the placement the expert weights are in in every full checkpoint
(``expert_placement``), moves loaded or fresh weights to the job's placement at start or resume, and
writes the last step's model-only export in the identity (logical order). A move is one all-to-all of
the rows that change rank; nothing is gathered whole. The routers keep logical expert ids; each MoE
layer maps them to slots (``expert_slot``) before dispatch.
See docs/balancing.md, "Placement from recorded routing".
"""

import re
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torchtitan.tools.logging import logger

from torchtitan_ext.models.moe import ExpertParallelMoE
from torchtitan_ext.balancing.placement import load_placement, Placement

STATE_KEY = "expert_placement"
_MOE = re.compile(r"layers\.(\d+)\.(?:.*\.)?moe$")


def moe_modules(model_parts) -> dict[int, torch.nn.Module]:
    """This rank's MoE modules by layer id."""
    found = {}
    for part in model_parts:
        for name, module in part.named_modules():
            match = _MOE.fullmatch(name)
            if match and hasattr(module, "experts"):
                found[int(match.group(1))] = module
    return found


class PlacementRecord(Stateful):
    """The placement the expert weights are in, as a checkpoint state: [layers, experts] slots."""

    def __init__(self, layers: list[int], num_experts: int):
        self.layers = torch.tensor(layers, dtype=torch.int64)
        self.expert_at_slot = torch.arange(num_experts).repeat(len(layers), 1)

    def reset(self) -> None:
        self.expert_at_slot.copy_(torch.arange(self.expert_at_slot.shape[1]))

    def placement(self, expert_parallel_degree: int) -> Placement:
        return Placement(
            self.expert_at_slot.shape[1], expert_parallel_degree,
            {int(layer): tuple(slots.tolist()) for layer, slots in zip(self.layers, self.expert_at_slot)},
        )

    def set(self, placement: Placement) -> None:
        for row, layer in enumerate(self.layers.tolist()):
            self.expert_at_slot[row] = torch.tensor(placement.layers[layer])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"layers": self.layers, "expert_at_slot": self.expert_at_slot}

    def load_state_dict(self, state_dict) -> None:
        problem = record_problem(state_dict["layers"], state_dict["expert_at_slot"], self.layers.tolist(),
                                 self.expert_at_slot.shape[1])
        if problem:
            raise ValueError(f"the checkpoint's expert placement record {problem}")
        self.expert_at_slot.copy_(state_dict["expert_at_slot"])


def record_problem(layers: torch.Tensor, expert_at_slot: torch.Tensor, moe_layers: list[int], num_experts: int) -> str | None:
    """Why a recorded placement cannot be this model's (None when it can): other MoE layers, another
    expert count, or a row that is not a permutation of the experts."""
    if layers.tolist() != list(moe_layers):
        return f"covers MoE layers {layers.tolist()}, this model's are {list(moe_layers)}: it is another model's checkpoint"
    if tuple(expert_at_slot.shape) != (len(moe_layers), num_experts):
        return f"has shape {tuple(expert_at_slot.shape)}, not {len(moe_layers)} layers x {num_experts} experts"
    for layer, row in zip(moe_layers, expert_at_slot):
        if sorted(row.tolist()) != list(range(num_experts)):
            return f"for MoE layer {layer} is {row.tolist()}, not a permutation of the experts: the checkpoint is damaged"
    return None


def read_record(checkpoint_id: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(layers, expert_at_slot) that a DCP checkpoint records, read in this process alone; None without a record."""
    metadata = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    names = ("layers", "expert_at_slot")
    if not all(f"{STATE_KEY}.{name}" in metadata for name in names):
        return None
    state = {STATE_KEY: {
        name: torch.empty(tuple(metadata[f"{STATE_KEY}.{name}"].size), dtype=metadata[f"{STATE_KEY}.{name}"].properties.dtype)
        for name in names
    }}
    with warnings.catch_warnings():
        # no_dist=True is this read's intent; torch still warns that it assumes one process, at every launch
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, checkpoint_id=checkpoint_id, no_dist=True)
    return state[STATE_KEY]["layers"], state[STATE_KEY]["expert_at_slot"]


class ExpertMigration:
    """The job's expert placement, applied at checkpoint load and undone for a model-only export."""

    def __init__(self, job_config, model_parts, optimizers, layers: list[int], num_experts: int, device: torch.device):
        path = job_config.expert_placement.file
        ep = job_config.parallelism.expert_parallel_degree
        self.target = load_placement(path) if path else Placement.identity(layers, num_experts, ep)
        self.source = path or "the identity"
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.record = PlacementRecord(layers, num_experts)
        self.expert_parallel_degree = ep
        self.device = device

    def attach(self, checkpointer) -> None:
        """Record the placement in ``checkpointer``'s saves and apply the target at its loads."""
        checkpointer.states[STATE_KEY] = self.record
        load, dcp_load, save = checkpointer.load, checkpointer.dcp_load, checkpointer.save

        def dcp_load_recorded(state_dict, checkpoint_id, from_hf, from_quantized):
            # the weights are in the placement the checkpoint records, whatever part of it is loaded (a
            # model-only load leaves the record out of torchtitan's states); none recorded: the identity
            records = not from_hf and _records_placement(checkpoint_id)
            if records:
                state_dict = {**state_dict, STATE_KEY: self.record}
            else:
                state_dict = {key: value for key, value in state_dict.items() if key != STATE_KEY}
            return dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)

        def load_then_place(step: int = -1) -> bool:
            # no checkpoint, or one without a record, leaves the weights in the identity
            self.record.reset()
            loaded = load(step)
            self.move_to(self.target, f"the job's placement ({self.source})")
            return loaded

        def save_export_in_identity(curr_step: int, last_step: bool = False) -> None:
            if last_step and checkpointer.enable and checkpointer.last_save_model_only:
                self.move_to(
                    Placement.identity(self.record.layers.tolist(), self.record.expert_at_slot.shape[1],
                                       self.expert_parallel_degree),
                    "the identity, for the model-only checkpoint of the last step",
                )
            return save(curr_step, last_step)

        checkpointer.dcp_load = dcp_load_recorded
        checkpointer.load = load_then_place
        checkpointer.save = save_export_in_identity

    def move_to(self, placement: Placement, why: str) -> None:
        """Move the expert rows from the recorded placement to ``placement``; every rank calls it."""
        current = self.record.placement(self.expert_parallel_degree)
        if current.layers != placement.layers:
            began = time.perf_counter()
            source_slots = {
                layer: _source_slots(current.layers[layer], placement.layers[layer]) for layer in placement.layers
            }
            moved_bytes = move_rows(self.model_parts, self.optimizers, source_slots)
            self.record.set(placement)
            logger.info(
                f"Expert placement: moved expert weights and optimizer state to {why}: {moved_bytes / 1e6:.2f} MB "
                f"sent by this rank in {time.perf_counter() - began:.3f} s"
            )
        self._map_routers(placement)

    def _map_routers(self, placement: Placement) -> None:
        for layer, moe in moe_modules(self.model_parts).items():
            slots = placement.layers[layer]
            if isinstance(moe, ExpertParallelMoE):
                slot_of = torch.empty(len(slots), dtype=torch.int64)
                slot_of[list(slots)] = torch.arange(len(slots))
                moe.expert_slot = None if placement.is_identity() else slot_of.to(self.device)
            elif slots != tuple(range(len(slots))):
                raise RuntimeError(f"MoE layer {layer} runs without expert parallelism and cannot hold a placement")


def _source_slots(current: tuple[int, ...], target: tuple[int, ...]) -> list[int]:
    """For each slot of ``target``, the slot of ``current`` that holds its expert now."""
    slot_now = {expert: slot for slot, expert in enumerate(current)}
    return [slot_now[expert] for expert in target]


def _records_placement(checkpoint_id: str) -> bool:
    keys = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    return any(key.startswith(f"{STATE_KEY}.") for key in keys)


def expert_tensors(model_parts, optimizers, layers) -> list[tuple[str, torch.Tensor]]:
    """(name the same on every rank, tensor) of every expert weight of ``layers`` on this rank and each of
    its optimizer states of the weight's shape, sorted by name."""
    states = {}
    for optimizer in optimizers.optimizers:
        for parameter, state in optimizer.state.items():
            states[parameter] = state
    found = []
    for layer, moe in moe_modules(model_parts).items():
        if layer not in layers:
            continue
        for name, parameter in moe.experts.named_parameters():
            key = f"layers.{layer}.moe.experts.{name}"
            found.append((key, parameter))
            for state_name, value in states.get(parameter, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == parameter.shape:
                    found.append((f"{key}:{state_name}", value))
    return sorted(found, key=lambda item: item[0])


def _rows_held(tensor: torch.Tensor) -> tuple[torch.Tensor, int, tuple]:
    """(local tensor, first global row, the local block of the other dims) of an expert tensor."""
    if not isinstance(tensor, DTensor):
        return tensor.data, 0, ()
    local = tensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(local.shape):
        raise NotImplementedError(
            f"expert tensor sharded as {tensor.placements}: its local rows are not one block of the global rows"
        )
    return local, int(offset[0]), tuple(zip(offset[1:], shape[1:]))


@torch.no_grad()
def move_rows(model_parts, optimizers, source_slots: dict[int, list[int]]) -> int:
    """Give every expert tensor of the layers in ``source_slots`` the rows ``new[s] = old[source_slots[L][s]]``.

    Each rank announces which global rows of which tensors it holds; the rank
    holding a needed row (itself if it can, else the nearest rank) sends it, in
    one all-to-all per dtype over the world. Returns the bytes this rank sent.
    """
    tensors = expert_tensors(model_parts, optimizers, set(source_slots))
    held = []
    for key, tensor in tensors:
        local, first_row, block = _rows_held(tensor)
        held.append((key, first_row, local.shape[0], block, str(local.dtype)))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    announced = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(announced, held)
    else:
        announced = [held]
    holders: dict[tuple, list[tuple[int, int, int]]] = {}
    for peer, entries in enumerate(announced):
        for key, first_row, rows, block, _ in entries:
            holders.setdefault((key, block), []).append((peer, first_row, rows))

    def source_of(peer: int, key: str, block: tuple, slot: int) -> tuple[int, int]:
        """(rank, its local row) that ``peer`` takes global row ``slot`` of ``key`` from."""
        candidates = [(p, slot - first) for p, first, rows in holders[(key, block)] if first <= slot < first + rows]
        return min(candidates, key=lambda c: (c[0] != peer, abs(c[0] - peer), c[0]))

    layer_of = {key: int(key.split(".")[1]) for key, _ in tensors}
    for entries in announced:
        layer_of.update({entry[0]: int(entry[0].split(".")[1]) for entry in entries})
    dtypes = sorted({entry[4] for entries in announced for entry in entries})
    sent_bytes = 0
    for dtype in dtypes:
        # what each peer sends me (in its order), and what I send each peer
        receive = [[] for _ in range(world)]
        send = [[] for _ in range(world)]
        for peer, entries in enumerate(announced):
            for key, first_row, rows, block, entry_dtype in entries:
                if entry_dtype != dtype:
                    continue
                for local_row in range(rows):
                    slot = source_slots[layer_of[key]][first_row + local_row]
                    source, source_row = source_of(peer, key, block, slot)
                    if peer == rank:
                        receive[source].append((key, local_row))
                    if source == rank:
                        send[peer].append((key, source_row))
        locals_by_key = {key: _rows_held(tensor)[0] for key, tensor in tensors}
        row_numel = {key: locals_by_key[key][0].numel() if locals_by_key[key].shape[0] else 0 for key in locals_by_key}
        outgoing = [locals_by_key[key][row].reshape(-1) for peer in range(world) for key, row in send[peer]]
        send_sizes = [sum(row_numel[key] for key, _ in send[peer]) for peer in range(world)]
        receive_sizes = [sum(row_numel[key] for key, _ in receive[peer]) for peer in range(world)]
        device = next(iter(locals_by_key.values())).device if locals_by_key else _default_device()
        torch_dtype = getattr(torch, dtype.removeprefix("torch."))
        send_buffer = torch.cat(outgoing) if outgoing else torch.empty(0, dtype=torch_dtype, device=device)
        receive_buffer = torch.empty(sum(receive_sizes), dtype=torch_dtype, device=device)
        if world > 1:
            dist.all_to_all_single(receive_buffer, send_buffer, receive_sizes, send_sizes)
        else:
            receive_buffer.copy_(send_buffer)
        sent_bytes += (send_buffer.numel() - send_sizes[rank]) * send_buffer.element_size()
        offset = 0
        for peer in range(world):
            for key, row in receive[peer]:
                local = locals_by_key[key]
                local[row].copy_(receive_buffer[offset:offset + row_numel[key]].view_as(local[row]))
                offset += row_numel[key]
    return sent_bytes


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
