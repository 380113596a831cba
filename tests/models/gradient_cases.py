"""The gradient matrix's cells and their per-rank worker.

A cell is one (model, EP backend, parallelism) combination. Its worker builds a
tiny DeepSeek-V3, Llama4, Qwen3-MoE or GPT-OSS on every rank with the same seed, keeps an
unparallelized copy whose MoE layers compute densely (every expert applied to
the tokens that picked it, no dispatch at all), applies the job's parallelize
plan (and pipeline split) to the other copy exactly as training does, runs one
forward and backward on this rank's share of a global batch (loss: summed
cross-entropy over the global valid tokens, as torchtitan's trainer), and
returns the loss, this rank's shard of every parameter's gradient and the
gradient norm (torchtitan's ``clip_grad_norm_``, before clipping), and where TP
shards the gradients, every gradient shard after torchtitan's clipping
(``CLIP_MAX_NORM``). The test assembles the full gradients from every rank's
shards and compares them with the dense copy's, computed in fp32 on the whole
batch.
"""

import contextlib
import copy
import gc
import os
import types
import weakref
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_ext.ep.backends import backend_variants, MATRIX_VARIANTS

SEQ_LEN = 16
VOCAB = 128
SEED = 7
CLIP_MAX_NORM = 1e-4
"""max_norm of the real clipping in TP cells: far below any cell's gradient norm, so that the clip
coefficient is torchtitan's norm itself (max_norm / (norm + 1e-6))."""


@dataclass(frozen=True)
class Cell:
    name: str
    model: str
    backend: str | None
    """None: no EP (the backend is not used)."""
    world_size: int
    overrides: tuple[str, ...] = ()
    batch_per_rank: tuple[int, ...] = ()
    """Sequences of each data-parallel rank; empty: 2 each."""
    bf16: bool = False
    """Computation in bf16 somewhere (mixed precision, grouped GEMM): compare at bf16 rounding."""
    grouped_mm: bool = False
    empty_last_rank: bool = False
    """The router never picks the last EP rank's experts: that rank receives nothing."""
    mutant: str | None = None
    """A known defect re-introduced, to show that the comparison catches it."""
    replicas: int = 0
    """Replica slots per EP rank ([expert_replication] slots_per_rank), each holding a copy of one of the
    other rank's experts (:data:`REPLICAS`)."""
    plan_change: bool = False
    """A forward and backward under other replicas (:data:`REPLICAS_BEFORE`) first, its gradients dropped: the
    checked pass runs after a plan change, on tables and index tensors rebuilt between steps as training does."""

    @property
    def id(self) -> str:
        return f"{self.model}-{self.backend or 'no_ep'}-{self.name}"


def tiny_model_args(model: str, grouped_mm: bool, load_balance: bool = True):
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
    from torchtitan.models.gpt_oss.model.args import GptOssModelArgs
    from torchtitan.models.llama4.model.args import TransformerModelArgs
    from torchtitan.models.moe.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    coeff = 1e-3 if load_balance else None
    if model == "qwen3":
        return Qwen3ModelArgs(
            vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, hidden_dim=64, qk_norm=True,
            max_seq_len=64, moe_enabled=True, moe_inter_dim=16,
            moe_args=MoEArgs(num_experts=8, num_shared_experts=0, score_func="softmax", route_norm=True, top_k=3,
                             score_before_experts=False, use_grouped_mm=grouped_mm, load_balance_coeff=coeff),
        )
    if model == "gpt_oss":
        # swiglu_limit 0.05 clamps a share of the tiny model's pre-activations, so the clamp's gradient counts
        return GptOssModelArgs(
            vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, moe_inter_dim=16,
            max_seq_len=SEQ_LEN, sliding_window_size=4, swiglu_limit=0.05,
            moe_args=MoEArgs(num_experts=8, num_shared_experts=0, score_func="softmax", route_norm=True, top_k=3,
                             gate_bias=True, score_before_experts=False, use_grouped_mm=grouped_mm,
                             load_balance_coeff=coeff),
        )
    if model == "deepseek_v3":
        args = DeepSeekV3ModelArgs(
            vocab_size=VOCAB, dim=32, inter_dim=64, moe_inter_dim=16, n_layers=4, n_dense_layers=1,
            n_heads=2, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8, max_seq_len=64,
            moe_args=MoEArgs(num_experts=8, num_shared_experts=1, score_func="softmax", top_k=3,
                             score_before_experts=False, use_grouped_mm=grouped_mm, load_balance_coeff=coeff),
        )
        args.moe_impl = "standard"  # what our train spec's update_from_config sets
        return args
    return TransformerModelArgs(
        dim=32, n_layers=4, n_heads=2, vocab_size=VOCAB, multiple_of=16, max_seq_len=64,
        interleave_moe_layer_step=2,
        moe_args=MoEArgs(num_experts=8, num_shared_experts=1, score_func="sigmoid", top_k=1,
                         score_before_experts=True, use_grouped_mm=grouped_mm, load_balance_coeff=coeff),
    )


def _swiglu_expert(experts, expert: int, rows: torch.Tensor) -> torch.Tensor:
    """torchtitan's standard expert: w2 (silu(w1 x) * w3 x), no bias."""
    w1, w2, w3 = experts.w1[expert], experts.w2[expert], experts.w3[expert]
    return (F.silu(rows @ w1.t()) * (rows @ w3.t())) @ w2.t()


def _gpt_oss_expert(experts, expert: int, rows: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's expert as its reference implementation defines it: h = mlp1 x + b1, its even columns the gate
    and odd ones the linear half, each clamped to the SwiGLU limit (the gate from above only), then
    mlp2 (gate * sigmoid(1.702 gate) * (linear + 1)) + b2."""
    limit = experts.swiglu_limit
    h = rows @ experts.mlp1_weight[expert].t() + experts.mlp1_bias[expert]
    gate, linear = h[:, 0::2].clamp(max=limit), h[:, 1::2].clamp(-limit, limit)
    return (gate * torch.sigmoid(1.702 * gate) * (linear + 1)) @ experts.mlp2_weight[expert].t() + experts.mlp2_bias[expert]


def dense_moe_forward(moe, x: torch.Tensor) -> torch.Tensor:
    """The MoE layer by definition: out[t] = sum_k score[t,k] * expert_{id[t,k]}(x[t]) (Llama4: the
    expert of score * x[t]) + shared experts(x[t]); the router is the layer's own."""
    bs, slen, dim = x.shape
    x = x.reshape(-1, dim)
    scores, ids, _ = moe.router(x, moe.expert_bias)
    out = torch.zeros_like(x)
    run_expert = _swiglu_expert if hasattr(moe.experts, "w1") else _gpt_oss_expert
    for expert in range(moe.experts.num_experts):
        token, slot = (ids == expert).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        score = scores[token, slot].unsqueeze(1)  # fp32; products rounded to the activation dtype
        rows = (x[token] * score).to(x.dtype) if moe.score_before_experts else x[token]
        result = run_expert(moe.experts, expert, rows)
        out = out.index_add(0, token, result if moe.score_before_experts else (result * score).to(x.dtype))
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out.view(bs, slen, dim)


def _forward(model, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits, with the attention masks a FlexAttention model (GPT-OSS) takes, built as the trainer
    builds them."""
    if getattr(model.model_args, "attn_type", "sdpa") != "flex":
        return model(tokens)
    return model(tokens, attention_masks=model.get_attention_masks(tokens, tokenizer=None))


def _batch(cell: Cell, dp_size: int):
    sizes = cell.batch_per_rank or (2,) * dp_size
    generator = torch.Generator().manual_seed(SEED)
    total = sum(sizes)
    tokens = torch.randint(0, VOCAB, (total, SEQ_LEN), generator=generator)
    labels = torch.randint(0, VOCAB, (total, SEQ_LEN), generator=generator)
    starts = [sum(sizes[:r]) for r in range(dp_size)]
    return tokens, labels, [(start, start + size) for start, size in zip(starts, sizes)]


REPLICAS = {1: ((4,), (0,)), 2: ((4, 6), (0, 2))}
"""EP = 2, 8 experts: the home slots each rank's replica slots copy."""
REPLICAS_BEFORE = {2: ((5, -1), (1, 3))}
"""The replicas of a plan-change cell's first pass: other experts, and a slot unused."""


def _set_replicas(parts, replicas: tuple) -> list:
    """Give every MoE layer these replicas; returns the layers' routers, whose splits the cell reports."""
    from torchtitan_ext.ep.replication.plan import ReplicaPlan

    routers = []
    for part in parts:
        for module in part.modules():
            if getattr(module, "replicas", None) is not None:
                plan = ReplicaPlan(8, 2, replicas)
                module.replicas.set_plan(plan)
                module.experts.set_plan(plan)
                routers.append(module.replicas)
    return routers


def _job_config(cell: Cell, dp_shard: int, world_size: int):
    """The debug job with the cell's overrides, validated for the world size.

    Parsing a job config (tyro) costs about half a second, more than a cell's
    step: the debug job is parsed once per process and each cell sets its
    overrides on a copy, then goes through the same validation as training.
    """
    from torchtitan_ext.config import load_job_config, validate

    if "base" not in _BASE_CONFIG:
        _BASE_CONFIG["base"] = load_job_config(
            ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", str(SEQ_LEN)], "cpu"
        )
    job_config = copy.deepcopy(_BASE_CONFIG["base"])
    overrides = [
        "--model.name", cell.model,
        "--model.flavor", VALIDATED_FLAVOR.get(cell.model, "debugmodel"),
        "--training.local_batch_size", str(max(cell.batch_per_rank or (2,))),
        "--parallelism.data_parallel_shard_degree", str(dp_shard),
        *(backend_variants()[cell.backend] if cell.backend is not None else []),
        *cell.overrides,
        "--expert_replication.slots_per_rank", str(cell.replicas),
    ]
    for key, value in zip(overrides[::2], overrides[1::2]):
        section, name = key.removeprefix("--").split(".")
        target = getattr(job_config, section)
        current = getattr(target, name)
        setattr(target, name, value if isinstance(current, str) else (type(current) if current is not None else float)(value))
    validate(job_config, device_type="cpu", world_size=world_size)
    return job_config


_BASE_CONFIG: dict = {}
VALIDATED_FLAVOR = {"qwen3": "debugmodel_moe_small", "gpt_oss": "debugmodel_small"}
"""The flavour a cell's job config names, for validation (the cell builds its own tiny model): one with MoE
layers of the model's kind (Qwen3's "debugmodel" is dense)."""


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().float().clone()


def _grad_shards(parts) -> dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """{name: (this rank's shard of the gradient in fp32, its offset in the full gradient, the full shape)}, zeros
    for a parameter the step did not reach. The test assembles the full gradients from every rank's shards
    (:func:`full_gradients`): a gather per parameter here took a fifth of the matrix's time."""
    shards = {}
    for part in parts:
        for name, param in part.named_parameters():
            grad = (param.grad if param.grad is not None else torch.zeros_like(param)).detach()
            if isinstance(grad, DTensor):
                if any(placement.is_partial() for placement in grad.placements):
                    grad = grad.redistribute(placements=[Replicate() if placement.is_partial() else placement
                                                         for placement in grad.placements])
                _, offset = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, grad.placements)
                local = grad.to_local()
            else:
                offset, local = (0,) * grad.dim(), grad
            shards[_plain_name(name)] = (local.float().clone(), tuple(offset), tuple(grad.shape))
    return shards


def full_gradients(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """{name: full gradient} from every rank's :func:`_grad_shards` (a replicated shard is written by each rank
    that holds it)."""
    full = {}
    for shards in ranks:
        for name, (local, offset, shape) in shards.items():
            target = full.setdefault(name, torch.zeros(shape))
            target[tuple(slice(start, start + size) for start, size in zip(offset, local.shape))] = local
    return full


def _plain_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def _mesh_size(parallel_dims, name: str) -> tuple[int, int]:
    mesh = parallel_dims.get_optional_mesh(name)
    return (1, 0) if mesh is None else (mesh.size(), mesh.get_local_rank())


class ReplicaCopyCounter(TorchDispatchMode):
    """Counts, while they are alive, the tensors each MoE layer computes its experts from under replication:
    its copy of the L home experts beside the S replicas (``torch.cat`` into [L + S, ...], one tensor per
    parameter of an expert, of ``expert_shapes``) and its fetched replicas (``replica_weights``' output). A tensor
    counts until its storage is freed, whoever holds it: autograd's saved tensors, activation checkpointing's, or
    the forward itself."""

    def __init__(self, rows: int, expert_shapes: set[tuple[int, ...]]):
        from torchtitan_ext.ep.replication import transport_ops

        super().__init__()
        self.rows, self.expert_shapes = rows, expert_shapes
        self.replica_weights = transport_ops().replica_weights.default
        self.alive = {"copies": 0, "fetched": 0}
        self.most = dict(self.alive)
        self.most_in_backward = None
        self.at_forward_end = None
        self.alive_elements = self.most_elements = 0
        """Elements of both kinds alive now, and the most at once."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default and out.shape[0] == self.rows and (
                tuple(out.shape[1:]) in self.expert_shapes):
            self._born("copies", out)
        elif func is self.replica_weights:
            self._born("fetched", out)
        return out

    def _born(self, kind: str, tensor: torch.Tensor) -> None:
        self.alive[kind] += 1
        self.most[kind] = max(self.most[kind], self.alive[kind])
        self.alive_elements += tensor.numel()
        self.most_elements = max(self.most_elements, self.alive_elements)
        if self.most_in_backward is not None:
            self.most_in_backward[kind] = max(self.most_in_backward[kind], self.alive[kind])
        # the storage, not the tensor: checkpointing keeps detached aliases of what it saves
        weakref.finalize(tensor.untyped_storage(), self._died, kind, tensor.numel())

    def _died(self, kind: str, elements: int) -> None:
        self.alive[kind] -= 1
        self.alive_elements -= elements

    def forward_ended(self) -> None:
        """Forward is done: what is alive now is what it leaves for backward; the backward's most starts here."""
        before = dict(self.alive)
        gc.collect()
        assert self.alive == before, "a counted tensor was held only by a reference cycle"
        self.at_forward_end = dict(self.alive)
        self.most_in_backward = dict(self.alive)


def run_cell(rank: int, world_size: int, cell: Cell, count_replica_copies: bool = False) -> dict:
    """One cell on this rank: {"loss", "grads" (this rank's :func:`_grad_shards`), "grad_norm", ...}; with
    ``count_replica_copies`` (no pipeline parallelism), also "replica_copies": the most of each kind of
    :class:`ReplicaCopyCounter` alive at once during forward and backward, and how many forward left alive."""
    from torchtitan.distributed import activation_checkpoint
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_ext import runtime
    from torchtitan_ext.ep.base import RoutedExpertParallel
    from torchtitan_ext.models.moe import TensorParallelTokenSplit

    job_config, parallel_dims = _job(cell, world_size)
    p = job_config.parallelism
    spec = get_train_spec(cell.model)
    model_args = tiny_model_args(cell.model, cell.grouped_mm)
    torch.manual_seed(SEED)
    model = spec.model_cls(model_args)
    with torch.no_grad():
        model.init_weights()
        if cell.empty_last_rank:
            local = model_args.moe_args.num_experts // p.expert_parallel_degree
            for block in model.layers.values():
                if block.moe_enabled:
                    block.moe.expert_bias[-local:] = -1e4
    dp_size, dp_rank = _mesh_size(parallel_dims, "batch")
    tokens, labels, slices = _batch(cell, dp_size)
    start, end = slices[dp_rank]
    global_tokens = torch.tensor(float(labels.numel()))
    # rank 0 computes the dense references, each once: the same problem (weights, routing bias, batch) recurs for
    # every backend and parallelism. Copied before the plan shards the model
    key = (cell.model, cell.grouped_mm, cell.empty_last_rank and p.expert_parallel_degree, tuple(slices))
    loss_fn = spec.build_loss_fn(job_config)
    if rank == 0 and key not in _REFERENCES:
        _REFERENCES[key] = _reference_step(_dense(copy.deepcopy(model)), loss_fn, tokens, labels, global_tokens)
    if rank == 0 and cell.bf16 and (key, "bf16") not in _REFERENCES:
        _REFERENCES[key, "bf16"] = _reference_step(_dense(copy.deepcopy(model).to(torch.bfloat16)), loss_fn, tokens,
                                                   labels, global_tokens)

    score_dtypes = []
    RoutedExpertParallel._token_dispatch = _recording_score_dtypes(score_dtypes)
    if cell.mutant == "tp_borrow_without_gradient_gather":
        TensorParallelTokenSplit.split = _split_without_gradient_gather

    result = {"rank": rank}

    if parallel_dims.pp_enabled:
        schedule, parts, has_first, has_last = spec.pipelining_fn(
            model, parallel_dims, job_config, torch.device("cpu"), model_args, spec.parallelize_fn, loss_fn,
        )
        runtime.adapt_model_parts(parts)  # as the trainer does
        routers = _set_replicas(parts, REPLICAS[cell.replicas]) if cell.replicas else []
        losses = [] if has_last else None
        with loss_fn.normalized_by(global_tokens):
            targets = labels[start:end] if has_last else None
            if has_first:
                schedule.step(tokens[start:end], target=targets, losses=losses)
            else:
                schedule.step(target=targets, losses=losses)
        if has_last:
            result["loss"] = _global_loss(torch.stack(losses).sum() / global_tokens, parallel_dims)
    else:
        parts = [spec.parallelize_fn(model, parallel_dims, job_config)]
        runtime.adapt_model_parts(parts)  # as the trainer does
        loss_parallel = parallel_dims.tp_enabled and not p.disable_loss_parallel
        if cell.plan_change:
            _set_replicas(parts, REPLICAS_BEFORE[cell.replicas])
            with dist_utils.get_train_context(loss_parallel)():
                (loss_fn(_forward(parts[0], tokens[start:end]), labels[start:end]) / global_tokens).backward()
            parts[0].zero_grad(set_to_none=True)
        routers = _set_replicas(parts, REPLICAS[cell.replicas]) if cell.replicas else []
        counter = None
        if count_replica_copies:
            # torchtitan counts per-layer checkpointing's layers across the process: start this model at 0
            activation_checkpoint._layer_sac_count = 0
            local = model_args.moe_args.num_experts // p.expert_parallel_degree + cell.replicas
            # one expert's parameters (DeepSeek-V3's w1, w2, w3; GPT-OSS's two weights and their biases)
            experts = next(module.experts for module in parts[0].modules() if getattr(module, "replicas", None))
            expert_shapes = [tuple(parameter.shape[1:]) for parameter in experts.parameters()]
            counter = ReplicaCopyCounter(local, set(expert_shapes))
        with dist_utils.get_train_context(loss_parallel)(), counter or contextlib.nullcontext():
            pred = _forward(parts[0], tokens[start:end])
            loss = loss_fn(pred, labels[start:end]) / global_tokens
            if counter is not None:
                counter.forward_ended()
            loss.backward()
        result["loss"] = _global_loss(_full(loss), parallel_dims)
        if counter is not None:
            del pred
            result["replica_copies"] = {"most": counter.most, "most_elements": counter.most_elements,
                                        "expert_shapes": expert_shapes,
                                        "at_forward_end": counter.at_forward_end,
                                        "most_in_backward": counter.most_in_backward,
                                        "after_backward": dict(counter.alive)}

    result["grads"] = _grad_shards(parts)
    params = [param for part in parts for param in part.parameters()]
    clip_args = {"foreach": True, "pp_mesh": parallel_dims.get_optional_mesh("pp"),
                 "ep_enabled": parallel_dims.ep_enabled}
    # torchtitan's norm, without its clipping: clipping at an unreachable norm multiplies every
    # gradient by 1, and on DTensors that took a quarter of the matrix's time
    with mock.patch("torch.nn.utils.clip_grads_with_norm_"):
        result["grad_norm"] = float(dist_utils.clip_grad_norm_(params, max_norm=1e30, **clip_args))
    if parallel_dims.tp_enabled:
        # The training tests clip for real (max_norm 1.0) under FSDP, EP and PP; TP-sharded
        # gradients are clipped here, each by the coefficient torchtitan's norm gives
        dist_utils.clip_grad_norm_(params, max_norm=CLIP_MAX_NORM, **clip_args)
        result["clipped_grads"] = _grad_shards(parts)
    result["score_dtypes"] = sorted(set(score_dtypes))
    # pairs the replica copies took in this rank's layers (the split is the same on every rank)
    result["replica_pairs"] = sum(int(router.last_quotas[:, 1:].sum()) for router in routers if router.last_quotas is not None)

    if rank == 0:
        result["reference"] = _REFERENCES[key]
        if cell.bf16:
            result["reference_bf16"] = _REFERENCES[key, "bf16"]
    return result


def _job(cell: Cell, world_size: int):
    """(the cell's job config, its parallel dims): one set of process groups per layout, as in one job."""
    from torchtitan.distributed import ParallelDims

    job_config = _job_config(cell, _parallel_args(cell)["dp_shard"], world_size)
    p = job_config.parallelism
    degrees = (p.data_parallel_shard_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree,
               p.expert_parallel_degree, p.expert_tensor_parallel_degree)
    if degrees not in _PARALLEL_DIMS:
        dp_shard, tp, pp, ep, etp = degrees
        parallel_dims = ParallelDims(
            dp_shard=dp_shard, dp_replicate=1, cp=1, tp=tp, pp=pp, ep=ep, etp=etp, world_size=world_size
        )
        parallel_dims.build_mesh()
        _PARALLEL_DIMS[degrees] = parallel_dims
    return job_config, _PARALLEL_DIMS[degrees]


def ledger_worker(rank: int, world_size: int, cells: list[Cell]) -> dict:
    """Per cell (no pipeline parallelism): the device-cost ledger of one forward and backward of the cell's model,
    counted after one that builds what a job builds once, with the job's budget."""
    from torchtitan.protocols.train_spec import get_train_spec

    from tests.helpers import REPO_ROOT
    from torchtitan_ext import runtime
    from torchtitan_ext.measuring.device_cost_counter import DeviceCostCounter
    from torchtitan_ext.measuring.device_costs import LayerScopes
    from torchtitan_ext.measuring.device_ledger import job_budget, Ledger
    from torchtitan_ext.training import prepare

    os.chdir(REPO_ROOT)
    prepare()
    results = {}
    for cell in cells:
        job_config, parallel_dims = _job(cell, world_size)
        spec = get_train_spec(cell.model)
        torch.manual_seed(SEED)
        model = spec.model_cls(tiny_model_args(cell.model, cell.grouped_mm))
        with torch.no_grad():
            model.init_weights()
        parts = [spec.parallelize_fn(model, parallel_dims, job_config)]
        runtime.adapt_model_parts(parts)
        if cell.replicas:
            _set_replicas(parts, REPLICAS[cell.replicas])
        loss_fn = spec.build_loss_fn(job_config)
        dp_size, dp_rank = _mesh_size(parallel_dims, "batch")
        tokens, labels, slices = _batch(cell, dp_size)
        start, end = slices[dp_rank]

        def step():
            loss_fn(_forward(parts[0], tokens[start:end]), labels[start:end]).backward()

        step()
        scopes = LayerScopes(parts)
        counter = DeviceCostCounter(scopes, parts)
        with counter:
            step()
        scopes.remove()
        ac = job_config.activation_checkpoint
        results[cell.id] = Ledger(dict(counter.costs), parallel_dims.get_mesh("ep").get_group().group_name,
                                  job_budget(job_config), ac.mode == "selective" and ac.selective_ac_option == "op")
    return results


_PARALLEL_DIMS: dict[tuple, object] = {}
_REFERENCES: dict[tuple, dict] = {}


def _dense(model):
    """``model`` with every MoE layer computing :func:`dense_moe_forward`."""
    for block in model.layers.values():
        if block.moe_enabled:
            block.moe.forward = types.MethodType(dense_moe_forward, block.moe)
    return model


def _reference_step(model, loss_fn, tokens, labels, global_tokens) -> dict:
    """Loss, gradients (fp32) and gradient norm of one process computing the whole batch."""
    loss = loss_fn(_forward(model, tokens), labels) / global_tokens
    loss.backward()
    grads = {name: param.grad.detach().float().clone() for name, param in model.named_parameters()}
    return {
        "loss": float(loss.detach()),
        "grads": grads,
        "grad_norm": float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))),
    }


def _global_loss(loss: torch.Tensor, parallel_dims) -> float:
    """This rank's share of the loss summed over the data-parallel ranks."""
    from torchtitan.distributed import utils as dist_utils

    mesh = parallel_dims.get_optional_mesh("loss")
    return float(loss if mesh is None else dist_utils.dist_sum(loss.detach(), mesh))


def _parallel_args(cell: Cell) -> dict:
    """dp_shard for the cell: the world divided by the other degrees in its overrides."""
    degrees = {"tensor_parallel_degree": 1, "pipeline_parallel_degree": 1}
    for key, value in zip(cell.overrides, cell.overrides[1:]):
        name = key.removeprefix("--parallelism.")
        if name in degrees:
            degrees[name] = int(value)
    return {"dp_shard": cell.world_size // (degrees["tensor_parallel_degree"] * degrees["pipeline_parallel_degree"])}


def _recording_score_dtypes(dtypes: list):
    """``RoutedExpertParallel._token_dispatch`` that also records the dtype of the scores it
    receives (fp32 expected, whatever the parameter dtype)."""
    from torchtitan_ext.ep.base import RoutedExpertParallel

    original = RoutedExpertParallel._token_dispatch

    def token_dispatch(self, mod, inputs, device_mesh):
        dtypes.append(str(inputs[1].scores.dtype))
        return original(self, mod, inputs, device_mesh)

    return token_dispatch


def _split_without_gradient_gather(self, tensor):
    """Defect 1 as it was: each TP rank dispatches its slice, and its gradient is left partial."""
    return tensor.chunk(self.mesh.size())[self.mesh.get_local_rank()]


def matrix_worker(rank: int, world_size: int, cells: list[Cell], count_replica_copies: bool = False) -> dict:
    """Every cell of one world size, in one set of processes."""
    from tests.helpers import REPO_ROOT
    from torchtitan_ext.training import prepare

    os.chdir(REPO_ROOT)
    prepare()
    results = {}
    from torchtitan_ext.ep.base import RoutedExpertParallel
    from torchtitan_ext.models.moe import TensorParallelTokenSplit

    original_split, original_dispatch = TensorParallelTokenSplit.split, RoutedExpertParallel._token_dispatch
    for cell in cells:
        try:
            results[cell.id] = run_cell(rank, world_size, cell, count_replica_copies)
        finally:
            TensorParallelTokenSplit.split = original_split
            RoutedExpertParallel._token_dispatch = original_dispatch
    return results


def cells() -> list[Cell]:
    """The matrix: every backend x both scoring styles x each parallelism, plus the controls."""
    ac = {
        "ac_full": ("--activation_checkpoint.mode", "full"),
        "ac_selective_op": ("--activation_checkpoint.mode", "selective",
                            "--activation_checkpoint.selective_ac_option", "op"),
        "ac_selective_layer": ("--activation_checkpoint.mode", "selective",
                               "--activation_checkpoint.selective_ac_option", "1"),
    }
    ep2 = ("--parallelism.expert_parallel_degree", "2")
    tp2 = ("--parallelism.tensor_parallel_degree", "2")
    bf16 = ("--training.mixed_precision_param", "bfloat16")
    pp2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
           "--parallelism.pipeline_parallel_microbatch_size", "1")
    result = []
    for model in ("deepseek_v3", "llama4"):
        for backend in MATRIX_VARIANTS:
            result += [
                Cell("ep2_fsdp", model, backend, 2, ep2),
                Cell("ep2_fsdp_bf16", model, backend, 2, ep2 + bf16, bf16=True),
                Cell("ep2_borrowing_tp_batch1", model, backend, 2, ep2 + tp2, batch_per_rank=(1,)),
                Cell("ep2_borrowing_tp_batch2", model, backend, 2, ep2 + tp2),
                *(Cell(f"ep2_{name}", model, backend, 2, ep2 + args) for name, args in ac.items()),
                Cell("ep2_grouped_mm", model, backend, 2, ep2, bf16=True, grouped_mm=True),
                Cell("ep2_uneven_tokens", model, backend, 2, ep2, batch_per_rank=(2, 1)),
                Cell("ep2_rank_receives_nothing", model, backend, 2, ep2, empty_last_rank=True),
                Cell("ep2_pp2_fsdp2", model, backend, 4, ep2 + pp2),
            ]
            result += [Cell(f"ep2_replicas{slots}", model, backend, 2, ep2, replicas=slots) for slots in (1, 2)]
        result += [
            Cell("ep2_replicas2_fsdp_bf16", model, "nccl", 2, ep2 + bf16, bf16=True, replicas=2),
            Cell("ep2_replicas2_borrowing_tp_batch2", model, "nccl", 2, ep2 + tp2, replicas=2),
            *(Cell(f"ep2_replicas2_{name}", model, "nccl", 2, ep2 + args, replicas=2) for name, args in ac.items()),
            Cell("ep2_replicas2_grouped_mm", model, "nccl", 2, ep2, bf16=True, grouped_mm=True, replicas=2),
            Cell("ep2_replicas2_pp2_fsdp2", model, "nccl", 4, ep2 + pp2, replicas=2),
            Cell("tp2_only", model, None, 2, tp2 + ("--parallelism.expert_parallel_degree", "1")),
            Cell("ep2_expert_tp2", model, "nccl", 4,
                 ep2 + tp2 + ("--parallelism.expert_tensor_parallel_degree", "2")),
        ]
    for model in ("qwen3", "gpt_oss"):
        # the MoE layer is DeepSeek-V3's scoring style; what differs is the model around it and, for GPT-OSS, the
        # experts: every backend under EP with FSDP, the other parallelisms on nccl
        result += [Cell("ep2_fsdp", model, backend, 2, ep2) for backend in MATRIX_VARIANTS]
        result += [
            Cell("ep2_rank_receives_nothing", model, "nccl", 2, ep2, empty_last_rank=True),
            Cell("ep2_ac_selective_op", model, "nccl", 2, ep2 + ac["ac_selective_op"]),
        ]
    # Qwen3's TP plan runs attention on DTensors, which a CPU cannot (config validation refuses it there)
    result += [
        Cell("ep2_replicas2", "qwen3", "nccl", 2, ep2, replicas=2),
        # GPT-OSS's replicas carry its biases: fetched with the weights, their gradients summed at home
        Cell("ep2_replicas2", "gpt_oss", "nccl", 2, ep2, replicas=2),
        # a bias's gradient from its replica summed with its home's in bf16 and rounded once, as a weight's
        Cell("ep2_replicas2_fsdp_bf16", "gpt_oss", "nccl", 2, ep2 + bf16, bf16=True, replicas=2),
        Cell("ep2_replicas2_borrowing_tp_batch2", "gpt_oss", "nccl", 2, ep2 + tp2, replicas=2),
        *(Cell(f"ep2_replicas2_{name}", "gpt_oss", "nccl", 2, ep2 + ac[name], replicas=2)
          for name in ("ac_full", "ac_selective_op")),
        Cell("ep2_replicas1", "gpt_oss", "hybridep", 2, ep2, replicas=1),
        Cell("ep2_replicas2_grouped_mm", "gpt_oss", "nccl", 2, ep2, bf16=True, grouped_mm=True, replicas=2),
        Cell("ep2_borrowing_tp_batch2", "gpt_oss", "nccl", 2, ep2 + tp2),
        Cell("tp2_only", "gpt_oss", None, 2, tp2 + ("--parallelism.expert_parallel_degree", "1")),
    ]
    result.append(Cell("ep2_replicas2_after_a_plan_change", "deepseek_v3", "nccl", 2, ep2, replicas=2,
                       plan_change=True))
    # 4 ranks at EP = 2: FSDP gathers the experts across 2 ranks, and each layer fetches the next one's replicas
    # after its combine, once FSDP has unsharded them
    result.append(Cell("ep2_replicas2_experts_fsdp2", "deepseek_v3", "nccl", 4, ep2, replicas=2))
    result.append(Cell("mutant_defect1", "deepseek_v3", "nccl", 2, ep2 + tp2,
                       mutant="tp_borrow_without_gradient_gather"))
    return result
