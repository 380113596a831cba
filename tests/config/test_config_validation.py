"""Config parsing and validation: torchtitan keys unchanged, bad input named with its fix."""

import copy
import dataclasses
from pathlib import Path

import pytest
import tomli_w
from torchtitan.config import JobConfig as TorchTitanJobConfig

from torchtitan_ext.ep.backends import KERNEL_LIBRARY_BACKENDS
from torchtitan_ext.config import comm_backend, ConfigError, load_job_config, validate
from torchtitan_ext.config import parse as parse_job_config
from torchtitan_ext.config.ranges import check_ranges, numeric_fields
from torchtitan_ext.config.registry import field_ranges, job_config_class
from torchtitan_ext.training.specs import register_train_specs  # importing training registers every section

DEBUG_TOML = "train_configs/debug_model.toml"


@pytest.fixture(autouse=True, scope="module")
def specs():
    register_train_specs()


def _without_none(value):
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value


def test_every_torchtitan_key_is_accepted(tmp_path):
    """A TOML with every torchtitan 0.2.2 section and key parses to the same values."""
    values = _without_none(dataclasses.asdict(TorchTitanJobConfig()))
    values["training"]["steps"] = 7
    values["parallelism"]["expert_parallel_degree"] = 2
    path = tmp_path / "all_keys.toml"
    path.write_bytes(tomli_w.dumps(values).encode())
    config = parse_job_config(["--job.config_file", str(path)])
    parsed = dataclasses.asdict(config)
    for section, keys in values.items():
        for key, value in keys.items():
            assert _without_none(parsed[section][key]) == value, f"{section}.{key}"


def test_cli_overrides_of_torchtitan_and_our_keys():
    config = parse_job_config([
        "--job.config_file", DEBUG_TOML,
        "--training.steps", "3",
        "--training.no-enable-cpu-offload",
        "--parallelism.expert_parallel_comm_backend", "hybridep",
        "--hybridep.non_blocking_capacity_factor", "0.5",
        "--activation_checkpoint.mode", "full",
    ])
    assert config.training.steps == 3
    assert config.hybridep.non_blocking_capacity_factor == 0.5
    assert config.activation_checkpoint.mode == "full"
    assert comm_backend(config) == "hybridep"


def test_standard_is_an_alias_of_nccl():
    config = parse_job_config(["--job.config_file", DEBUG_TOML, "--parallelism.expert_parallel_comm_backend", "standard"])
    assert comm_backend(config) == "nccl"


def test_a_jobs_parse_warning_shows_once_across_its_overrides_and_a_missing_assets_folder_not_at_all(
        tmp_path, caplog):
    """The layout advisor parses one job per layout; a plan or a dry run checks a job for other machines, whose
    assets folder this one lacks (the pre-flight checks it where the ranks read it)."""
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    missing = tmp_path / "no_assets"
    for steps in ("3", "4"):
        parse_job_config(["--job.config_file", DEBUG_TOML, "--model.tokenizer_path", str(tokenizer),
                          "--training.steps", steps])
        parse_job_config(["--job.config_file", DEBUG_TOML, "--model.hf_assets_path", str(missing),
                          "--training.steps", steps])
    messages = [r.getMessage() for r in caplog.records]
    assert sum(message.startswith("tokenizer_path is deprecated") for message in messages) == 1, messages
    assert not any(str(missing) in message for message in messages), messages


def _load(*overrides, device_type="cpu", world_size=2):
    return load_job_config(["--job.config_file", DEBUG_TOML, *overrides], device_type, world_size)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("--parallelism.expert_parallel_comm_backend", "alltoall"),
         "parallelism.expert_parallel_comm_backend = 'alltoall' is not a backend"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.non_blocking_capacity_factor", "1.5"),
         "hybridep.non_blocking_capacity_factor = 1.5: use a value > 0 and <= 1"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.non_blocking_capacity_factor", "0"),
         "hybridep.non_blocking_capacity_factor = 0.0: use a value > 0 and <= 1"),
        (("--hybridep.non_blocking_capacity_factor", "0.5"),
         "--hybridep.non_blocking_capacity_factor is set but parallelism.expert_parallel_comm_backend is 'nccl': "
         "remove it or select --parallelism.expert_parallel_comm_backend hybridep"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--deepep.implementation", "reference"),
         "--deepep.implementation is set but parallelism.expert_parallel_comm_backend is 'hybridep'"),
        (("--parallelism.expert_parallel_degree", "3"),
         "parallelism.expert_parallel_degree = 3 does not divide the model's 8 experts"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.ranks_per_nvlink_domain", "4"),
         "hybridep.ranks_per_nvlink_domain = 4 does not divide parallelism.expert_parallel_degree = 2"),
        (("--parallelism.expert_parallel_comm_backend", "deepep", "--deepep.implementation", "deep_ep"),
         "deepep.implementation = 'deep_ep' needs CUDA"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.implementation", "deep_ep"),
         "hybridep.implementation = 'deep_ep' needs CUDA"),
        (("--parallelism.expert_parallel_comm_backend", "deepep", "--deepep.num_sms", "3"),
         "deepep.num_sms = 3: use an even integer >= 2"),
        (("--parallelism.data_parallel_shard_degree", "4"),
         "dp_replicate x dp_shard x cp x tp x pp = 4 but the world size is 2"),
        (("--model.flavor", "tiny"), "model.flavor = 'tiny' is not a flavour of deepseek_v3"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--parallelism.expert_parallel_degree", "1"),
         "'hybridep' needs expert parallelism, but expert_parallel_degree = 1"),
        (("--model.name", "gpt9"), "model.name = 'gpt9' is not a registered model: use one of deepseek_v3,"),
        (("--training.steps", "0"), "training.steps = 0: use a value >= 1 (training steps)"),
        (("--training.steps", "-3"), "training.steps = -3: use a value >= 1"),
        (("--training.seq_len", "0"), "training.seq_len = 0: use a value >= 1 (tokens per sequence)"),
        (("--training.local_batch_size", "0"), "training.local_batch_size = 0: use a value >= 1"),
        (("--metrics.log_freq", "0"), "metrics.log_freq = 0: use a value >= 1"),
        (("--optimizer.lr", "-1"), "optimizer.lr = -1.0: use a value > 0"),
        (("--training.global_batch_size", "6"),
         "training.global_batch_size = 6 is not a multiple of local_batch_size x data-parallel ranks = 4 x 2"),
        (("--training.steps", "abc"), "--training.steps abc: use an integer"),
        (("--activation_checkpoint.mode", "sometimes"),
         "--activation_checkpoint.mode sometimes: use one of 'selective', 'full', 'memory_budget', 'none'"),
        (("--activation_checkpoint.mode", "memory_budget"),
         "activation_checkpoint.mode = 'memory_budget' works through torch.compile"),
        (("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "banana"),
         "activation_checkpoint.selective_ac_option = 'banana': use 'op' (per operator) or a positive integer N"),
        (("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "0"),
         "activation_checkpoint.selective_ac_option = '0'"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.non_blocking_capacity_factor", "1e-9"),
         "hybridep.non_blocking_capacity_factor = 1e-09 leaves 0 rows per dispatch"),
        (("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "DualPipeV",
          "--activation_checkpoint.mode", "full"),
         "'DualPipeV' overlapping expert parallelism cannot run with activation_checkpoint.mode = 'full'"),
        (("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "DualPipeV"),
         "overlaps expert parallelism on CUDA streams, which a CPU does not have"),
        (("--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "1",
          "--parallelism.pipeline_parallel_microbatch_size", "4"),
         "pipeline_parallel_schedule = '1F1B' needs at least as many microbatches as its 2 stages, but "
         "training.local_batch_size = 4 / pipeline_parallel_microbatch_size = 4 gives 1: raise local_batch_size to 8"),
        (("--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "1",
          "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--training.local_batch_size", "5"),
         "gives 5, not a multiple of its 2 rounds"),
        (("--training.dataset_path", "/data/c4"),
         "training.dataset_path = '/data/c4' but training.dataset = 'stdlib_code', an embedded dataset"),
        (("--training.dataset", "stdlib_cod"),
         "training.dataset = 'stdlib_cod' is not in torchtitan's dataset registry: did you mean 'stdlib_code'?"),
        (("--model.name", "qwen3"), "parallelism.expert_parallel_degree = 2, but model.name = 'qwen3', flavor "
         "'debugmodel' has no routed experts: set it to 1, or use an MoE flavour (debugmodel_moe, 30B-A3B"),
        (("--model.name", "llama3"), "parallelism.expert_parallel_degree = 2, but model.name = 'llama3', flavor "
         "'debugmodel' has no routed experts: set it to 1"),
        (("--model.name", "qwen3", "--parallelism.expert_parallel_degree", "1"),
         "model.flavor = 'debugmodel' ties the output projection to the embedding (enable_weight_tying)"),
        (("--model.name", "qwen3", "--parallelism.expert_parallel_degree", "1", "--parallelism.data_parallel_shard_degree",
          "1", "--parallelism.data_parallel_replicate_degree", "2"), None),  # DDP shares the tied weight as one
        (("--training.stepz", "3"), "unknown config key 'training.stepz' in the command line: did you mean 'steps'?"),
        (("--trainin.steps", "3"), "unknown config key 'trainin' in the command line: did you mean 'training'?"),
        (("--training.steps", "2.5"), "--training.steps 2.5: use an integer"),
        (("--optimizer.lr", "nan"), "--optimizer.lr nan: use a finite number"),
        (("--optimizer.lr", "inf"), "--optimizer.lr inf: use a finite number"),
        (("--optimizer.beta2", "1.0"), "optimizer.beta2 = 1.0: use a value >= 0 and < 1"),
        (("--training.enable_cpu_offload=maybe",), "--training.enable_cpu_offload maybe: --training.enable_cpu_offload "
         "is a switch and takes no value: --training.enable_cpu_offload turns it on, --training.no_enable_cpu_offload off"),
        (("--compile.enable", "false"), "--compile.enable false: --compile.enable is a switch and takes no value"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.use_mnnvl", "true"),
         "--hybridep.use_mnnvl true: use True or False"),
        (("--training.steps", "--compile.enable"), "--training.steps has no value: give one"),
        (("training.steps=3",), "'training.steps=3' is not a setting: write --training.steps=3"),
        (("--job.description", "-x"), "--job.description has no value: give one, as in --job.description <value> (a "
         "value that starts with '-' follows '=': --job.description=-x)"),
        (("--parallelism.module_fqns_per_model_part",), None),  # a list of lists: no word is the empty list
        (("--training.steps", "3", "4"), "'4' follows no setting that takes it: write each setting as --section.key "
         "value"),
        (("--faults.on_nonfinite", "ignore"), "use one of 'stop', 'skip_step'"),
        (("--checkpoint.keep_latest_k", "1"), "checkpoint.keep_latest_k = 1: torchtitan keeps at least 2"),
        (("--checkpoint.enable", "--checkpoint.export_dtype", "bfloat16", "--checkpoint.no_last_save_model_only"),
         "checkpoint.export_dtype = 'bfloat16' converts the last save only where it holds the model alone, but "
         "checkpoint.last_save_model_only is off"),
        (("--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
         "parallelism.context_parallel_degree = 2 on a CPU: torch's context parallelism shards SDPA's CUDA kernels only"),
        (("--training.enable_cpu_offload",), "training.enable_cpu_offload on a CPU: it moves parameters from GPU"),
        (("--checkpoint.enable", "--checkpoint.async_mode", "async_with_pinned_mem"),
         "checkpoint.async_mode = 'async_with_pinned_mem' on a CPU: it stages through pinned memory, which needs a GPU"),
        (("--fault_tolerance.enable",), "fault_tolerance.enable is set, but torchtitan 0.2.2's trainer, which this "
         "harness extends, has no TorchFT"),
        (("--memory_estimation.enable",), "memory_estimation.enable is set, but no trainer of torchtitan 0.2.2 reads it"),
        (("--validation.enable", "--validation.seq_len", "512"),
         "validation.seq_len = 512 is longer than the model's position table (max_seq_len = 256"),
        (("--validation.enable", "--validation.steps", "-1"), "validation.steps = -1 (the whole dataset) on 2 data-parallel"),
        (("--validation.enable", "--validation.seq_len", "63"),
         "validation.seq_len = 63 is not divisible by TP x 2 x CP = 2: use a multiple of 2"),
        (("--validation.enable", "--validation.dataset", "c4_validatoin"),
         "validation.dataset = 'c4_validatoin' is not in torchtitan's dataset registry: did you mean 'c4_validation'?"),
        (("--validation.enable", "--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "1",
          "--training.mixed_precision_param", "float32", "--validation.local_batch_size", "6"),
         "validation.local_batch_size = 6: the pipeline schedule splits every batch into its 4 microbatches"),
        (("--validation.enable", "--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "1",
          "--training.mixed_precision_param", "float32", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"),
         "validation.enable with pipeline_parallel_schedule = 'ZBVZeroBubble': torch's V-shaped schedules cannot run a "
         "forward-only pass"),
        (("--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "1023", "--training.local_batch_size",
          "4", "--parallelism.data_parallel_shard_degree", "1"),
         "training.seq_len = 1023 is not divisible by TP x 2 x CP = 4"),
        (("--model.flavor", "debugmodel_flex_attn", "--parallelism.context_parallel_degree", "2",
          "--parallelism.data_parallel_shard_degree", "1"),
         "parallelism.context_parallel_degree = 2: model.flavor = 'debugmodel_flex_attn' uses flex attention"),
        (("--job.custom_config_module", "no_such_module_here"),
         "job.custom_config_module = 'no_such_module_here' cannot be imported"),
        (("--job.custom_config_module", "json"), "job.custom_config_module = 'json' defines no JobConfig"),
        (("--expert_replication.slots_per_rank", "5"),
         "expert_replication.slots_per_rank = 5: a rank can hold copies of the other ranks' 4 experts only: set it to at most 4"),
        (("--expert_replication.slots_per_rank", "-1"), "expert_replication.slots_per_rank = -1: use a value >= 0"),
        (("--expert_replication.slots_per_rank", "1", "--expert_replication.adapt_every", "0"),
         "expert_replication.adapt_every = 0: use a value >= 1"),
        (("--expert_replication.slots_per_rank", "1", "--parallelism.expert_parallel_degree", "1"),
         "expert_replication.slots_per_rank = 1 needs expert parallelism: set parallelism.expert_parallel_degree > 1"),
        (("--expert_replication.slots_per_rank", "1", "--parallelism.tensor_parallel_degree", "2",
          "--parallelism.expert_tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"),
         "expert_replication.slots_per_rank = 1 is not supported with parallelism.expert_tensor_parallel_degree = 2"),
        (("--job.config_file",), "--job.config_file needs a path"),
        (("--job.config_file", "train_configs/llama4_debug_model.toml"),
         f"--job.config_file is given twice ('{DEBUG_TOML}' and 'train_configs/llama4_debug_model.toml')"),
        (("--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "1",
          "--parallelism.data_parallel_shard_degree", "1", "--parallelism.expert_parallel_comm_backend", "nccl",
          "--training.local_batch_size", "3", "--parallelism.pipeline_parallel_degree", "1"),
         None),
    ],
)
def test_invalid_values_name_the_field(overrides, message):
    if message is None:  # a valid neighbour of the cases above
        _load(*overrides)
        return
    world_size = 4 if "DualPipeV" in overrides or "--parallelism.expert_tensor_parallel_degree" in overrides else 2
    with pytest.raises(ConfigError) as error:
        _load(*overrides, world_size=world_size)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@dataclasses.dataclass
class Shapes:
    """A config section with every kind of field a section may have."""

    flag: bool = False
    maybe: bool | None = None
    count: int = 0
    rate: float = 1.0
    text: str = ""
    words: list[str] = dataclasses.field(default_factory=list)
    numbers: list[int] = dataclasses.field(default_factory=list)
    pair: tuple[int, int] = (0, 0)
    parts: list[list[str]] | None = None


@dataclasses.dataclass
class ShapesJob:
    shapes: Shapes = dataclasses.field(default_factory=Shapes)


CLI_SHAPES = [
    ("--shapes.flag",), ("--shapes.no-flag",), ("--shapes.no_flag",), ("--shapes.flag", "true"), ("--shapes.flag=False",),
    ("--shapes.maybe", "True"), ("--shapes.maybe", "None"), ("--shapes.maybe", "true"), ("--shapes.no_maybe",),
    ("--shapes.maybe",), ("--shapes.count", "-3"), ("--shapes.count",), ("--shapes.count", "3", "4"),
    ("--shapes.count", "--shapes.flag"), ("--shapes.rate", "-.5"), ("--shapes.rate", "-1e-3"), ("--shapes.text", "-x"),
    ("--shapes.text=-x",), ("--shapes.text", "- a"), ("--shapes.text", "-"), ("--shapes.text", "--"),
    ("--shapes.words", "a,b"), ("--shapes.words", "a", "b"), ("--shapes.numbers", "1", "2", "3"),
    ("--shapes.numbers",), ("--shapes.pair", "3", "4"), ("--shapes.parts", "a,b", "c"), ("--shapes.parts",),
    ("shapes.count=3",), ("--shapes.count", "3", "stray"),
]


@pytest.mark.parametrize("args", CLI_SHAPES, ids=" ".join)
def test_the_command_line_check_refuses_in_one_line_exactly_what_torchtitans_parser_refuses(args, capsys):
    """The oracle is the parser itself: torchtitan's ConfigManager parses with tyro and its own rules, on a config
    class whose section has every kind of field, and either parses the arguments or stops in its box; the check
    refuses, in one line, exactly the arguments it stops on. (The check runs before every parse: the messages'
    tests above go through parse_job_config.)"""
    import tyro
    from torchtitan.config import ConfigManager

    from torchtitan_ext.config import parsing

    registry = tyro.constructors.ConstructorRegistry()
    ConfigManager.register_tyro_rules(registry)
    try:
        tyro.cli(ShapesJob, args=list(args), default=ShapesJob(), registry=registry)
        tyro_accepts = True
    except SystemExit:
        tyro_accepts = False
    capsys.readouterr()
    try:
        parsing._check_cli(ShapesJob, list(args))
        refused = None
    except ConfigError as error:
        refused = str(error)
    assert (refused is None) == tyro_accepts, refused
    assert refused is None or "\n" not in refused


def test_a_validation_dispatch_larger_than_trainings_is_refused_where_the_backend_is_sized_by_it():
    """Training dispatches 4 x 256 tokens per rank; a validation batch of 8 dispatches twice that. hybridep's buffers
    (and deepep's, ncclep's) are made for training's dispatch: refused; nccl allocates each all-to-all's rows:
    accepted, its MoE shape still training's."""
    from torchtitan_ext.config import moe_shape

    larger = ("--validation.enable", "--validation.local_batch_size", "8")
    assert moe_shape(_load(*larger)).max_tokens_per_rank == 4 * 256
    with pytest.raises(ConfigError, match=r"^validation.local_batch_size x seq_len = 8 x 256 gives 2048 tokens per "
                                          r"rank per MoE dispatch, more than training's 1024, which hybridep's "
                                          r"buffers are made for"):
        _load(*larger, "--parallelism.expert_parallel_comm_backend", "hybridep")


def test_replica_slots_need_experts_that_a_replica_class_computes(monkeypatch):
    from torchtitan_ext.ep.replication import experts

    monkeypatch.setattr(experts, "REPLICA_EXPERTS", {})  # as for a model whose experts are none of torchtitan's
    with pytest.raises(ConfigError, match=r"^expert_replication.slots_per_rank = 1: deepseek_v3's routed experts "
                                          r"\(GroupedExperts\) take no replica slots .*: set slots_per_rank to 0$"):
        load_job_config(["--job.config_file", DEBUG_TOML, "--expert_replication.slots_per_rank", "1"], "cpu",
                        world_size=2)


def test_non_blocking_hybridep_rejects_overlapped_dualpipev():
    """Validated for a GPU cluster (device None): on CPU, DualPipeV's overlap is refused before."""
    with pytest.raises(ConfigError, match="non-blocking HybridEP cannot serve pipeline_parallel_schedule = 'DualPipeV'"):
        _load(
            "--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.non_blocking_capacity_factor", "0.8",
            "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "DualPipeV",
            device_type=None, world_size=4,
        )
    _load("--parallelism.expert_parallel_comm_backend", "hybridep",
          "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "DualPipeV",
          device_type=None, world_size=4)


def test_expert_tensor_parallel_rejected_for_kernel_backends():
    with pytest.raises(ConfigError, match="expert_tensor_parallel_degree = 2 is not supported by the 'deepep' backend"):
        _load(
            "--parallelism.expert_parallel_comm_backend", "deepep",
            "--parallelism.tensor_parallel_degree", "2",
            "--parallelism.expert_tensor_parallel_degree", "2",
            world_size=4,
        )


def test_a_dataset_a_custom_import_may_register_is_left_to_the_trainer():
    """torchtitan's trainer imports experimental.custom_import before it builds the dataloader: a dataset that
    module registers is unknown until then."""
    _load("--training.dataset", "my_corpus", "--experimental.custom_import", "my_datasets")


def test_valid_backend_configs_pass():
    for overrides in (
        (),
        ("--parallelism.expert_parallel_comm_backend", "deepep", "--deepep.implementation", "reference"),
        ("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.non_blocking_capacity_factor", "1.0",
         "--hybridep.ranks_per_nvlink_domain", "2", "--hybridep.use_mnnvl", "True"),
    ):
        _load(*overrides)


def test_auto_on_cuda_without_deep_ep_is_an_error():
    """No silent fallback: on CUDA, auto means the library, and its absence says how to install it."""
    import importlib.util

    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("deep_ep is installed here")  # the error path needs a machine without it
    for backend, branch in (("deepep", "DeepEP"), ("hybridep", "hybrid-ep branch")):
        with pytest.raises(ConfigError) as error:
            _load("--parallelism.expert_parallel_comm_backend", backend, device_type="cuda")
        message = str(error.value)
        assert f"{backend}.implementation resolves to the deep_ep library on CUDA" in message
        assert branch in message and f"{backend}.implementation = 'reference'" in message


def test_validate_needs_no_process_group():
    config = parse_job_config(["--job.config_file", DEBUG_TOML])
    validate(config, device_type="cpu", world_size=None)


def test_every_numeric_field_has_a_range():
    """A numeric field added to torchtitan's sections or ours cannot slip past range checking."""
    assert set(numeric_fields(job_config_class())) == set(field_ranges())


@pytest.fixture(scope="module")
def debug_config():
    """The debug job's config, parsed once (a parse takes a quarter of a second)."""
    return parse_job_config(["--job.config_file", DEBUG_TOML])


@pytest.mark.parametrize("key", sorted(field_ranges()))
def test_each_range_rejects_a_value_outside_it(key, debug_config):
    """Every numeric field refuses a value just outside its range, naming the field."""
    valid = field_ranges()[key]
    outside = valid.minimum - 1 if valid.minimum is not None else valid.maximum + 1
    while outside in valid.also:
        outside -= 1
    config = copy.deepcopy(debug_config)
    section, _, name = key.rpartition(".")
    target = config
    for part in section.split("."):
        target = getattr(target, part)
    setattr(target, name, outside)

    with pytest.raises(ConfigError, match=f"^{key} = "):
        check_ranges(config, {key: valid})


@pytest.mark.parametrize(
    "content, message",
    [
        ("[training\nsteps = 3\n", "is not valid UTF-8 TOML"),
        (b"[training]\nsteps = 3 # \xff\xfe\n", "is not valid UTF-8 TOML"),
        ("[training]\nstepz = 3\n", "unknown config key 'training.stepz' in {config}"),
        ('[training]\nsteps = "forty"\n', "training.steps = 'forty' in {config}: use an integer"),
        ("[training.steps]\nx = 1\n", "training.steps = {{'x': 1}}"),
        ("[trainer]\nsteps = 3\n", "unknown config key 'trainer'"),
        ("[training]\nsteps = true\n", "training.steps = True"),
        ("[optimizer]\nlr = nan\n", "optimizer.lr = nan"),
        ("[hybridep]\nnon_blocking_capacity_facter = 0.5\n", "'hybridep.non_blocking_capacity_facter' in {config}"),
    ],
    ids=["invalid_toml", "non_utf8", "unknown_key", "string_for_int", "table_for_value", "unknown_table",
         "bool_for_int", "nan", "misspelt_key_of_our_section"],
)
def test_toml_values_are_checked(tmp_path, content, message):
    config = tmp_path / "bad.toml"
    config.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as error:
        load_job_config(["--job.config_file", str(config)], "cpu", 2)
    assert message.format(config=config) in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("path", ["missing.toml", "."], ids=["missing", "a_folder"])
def test_a_config_file_that_is_not_one_is_named(tmp_path, path):
    with pytest.raises(ConfigError, match="not found: set CONFIG_FILE"):
        load_job_config(["--job.config_file", str(tmp_path / path)], "cpu", 2)


def test_a_relative_config_path_missing_outside_the_checkout_names_the_folder_and_a_config_that_exists(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        load_job_config(["--job.config_file", "train_configs/debug_model.toml"], "cpu", 2)
    message = str(error.value)
    assert f"(relative to {tmp_path}, where the command runs)" in message
    assert Path(message.rsplit("e.g. ", 1)[1]).is_file(), message


def _cluster(*overrides, config=DEBUG_TOML, world_size=2):
    """Validated for a GPU cluster (a dry run: device unknown, 'auto' means the library)."""
    return load_job_config(["--job.config_file", config, *overrides], None, world_size)


@pytest.mark.parametrize("backend", KERNEL_LIBRARY_BACKENDS)
def test_library_kernels_need_bf16(backend):
    with pytest.raises(ConfigError, match=(
        f"training.mixed_precision_param = 'float32', but .* bf16 .*{backend}.implementation resolves to deep_ep"
    )):
        _cluster("--parallelism.expert_parallel_comm_backend", backend, "--training.mixed_precision_param", "float32")
    _cluster("--parallelism.expert_parallel_comm_backend", backend, "--training.mixed_precision_param", "bfloat16")
    # the reference has no dtype limit
    _cluster("--parallelism.expert_parallel_comm_backend", backend, f"--{backend}.implementation", "reference",
             "--training.mixed_precision_param", "float32")


@pytest.mark.parametrize("backend", KERNEL_LIBRARY_BACKENDS)
def test_library_kernels_need_fsdp_for_bf16_tokens(backend):
    """EP borrowing the TP ranks without a data-parallel shard: torchtitan runs the model in fp32 (its mixed
    precision goes through FSDP), and the first dispatch handed the library fp32 tokens; refused before."""
    borrowing_tp = ("--parallelism.expert_parallel_comm_backend", backend, "--training.mixed_precision_param",
                    "bfloat16", "--parallelism.tensor_parallel_degree", "2")
    with pytest.raises(ConfigError, match=(
        rf"^parallelism.data_parallel_shard_degree is 1 \(and context_parallel_degree 1\): without FSDP, torchtitan "
        rf"runs the model in fp32 \(training.mixed_precision_param applies through FSDP\), and the {backend} kernels "
        rf"take bf16 tokens only: shard data parallelism \(data_parallel_shard_degree > 1\), or set "
        rf"{backend}.implementation = 'reference'$"
    )):
        _cluster(*borrowing_tp)
    _cluster(*borrowing_tp, world_size=4)  # the rest of the world shards data parallelism: FSDP casts
    # the reference takes any dtype: the job says the float32 it trains in (test_mixed_precision_needs_fsdp_under_tp_or_pp)
    _cluster(*borrowing_tp, f"--{backend}.implementation", "reference", "--training.mixed_precision_param", "float32")


def test_ddp_beside_tp_is_refused_before_its_ranks_raise():
    """torchtitan's DDP needs the whole world (models/parallelize.py raised "DDP does not support > 1D parallelism"
    in every rank)."""
    with pytest.raises(ConfigError, match=r"^parallelism.data_parallel_replicate_degree = 2 without a data-parallel "
                                          r"shard is DDP, which torchtitan runs only as the job's one parallelism"):
        _cluster("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                 "--parallelism.tensor_parallel_degree", "2", "--training.mixed_precision_param", "float32",
                 world_size=4)


@pytest.mark.parametrize("overrides, world_size, refused", [
    (("--parallelism.tensor_parallel_degree", "2"), 2, True),
    (("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
      "--parallelism.pipeline_parallel_microbatch_size", "1", "--parallelism.expert_parallel_degree", "1"), 2, True),
    (("--parallelism.tensor_parallel_degree", "2"), 4, False),  # FSDP over the other 2 ranks casts
    (("--parallelism.tensor_parallel_degree", "2", "--training.mixed_precision_param", "float32"), 2, False),
    (("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
      "--parallelism.expert_parallel_degree", "1"), 2, False),  # no TP or PP: autocast
], ids=["tp", "pp", "tp_fsdp", "tp_float32", "replicated"])
def test_mixed_precision_needs_fsdp_under_tp_or_pp(overrides, world_size, refused):
    """torchtitan's maybe_enable_amp leaves a TP or PP job without FSDP in float32 with a warning: the default
    bfloat16 (or any other) was not what such a job trained in."""
    job = ("--training.mixed_precision_param", "bfloat16", *overrides)
    if not refused:
        _cluster(*job, world_size=world_size)
        return
    with pytest.raises(ConfigError, match=r"^training.mixed_precision_param = 'bfloat16', but torchtitan mixes "
                                          r"precision through FSDP where TP or PP is on, .* it would train in float32"):
        _cluster(*job, world_size=world_size)


def test_deepep_v1_rank_counts(tmp_path):
    """256 experts: the 671B job, its [hybridep] section left out."""
    text = open("train_configs/deepseek_v3_671b_gb200.toml").read()
    start = text.index("[hybridep]")
    end = text.index("\n[", start + 1) if "\n[" in text[start + 1:] else len(text)
    config = tmp_path / "671b_deepep.toml"
    config.write_text(text[:start] + text[end:])
    config = str(config)
    with pytest.raises(ConfigError, match="expert_parallel_degree = 256: DeepEP's v1 kernels run on 2, 4 or 8 ranks"):
        _cluster("--parallelism.expert_parallel_comm_backend", "deepep", "--deepep.api", "legacy",
                 "--parallelism.expert_parallel_degree", "256", config=config, world_size=256)
    _cluster("--parallelism.expert_parallel_comm_backend", "deepep", "--deepep.api", "legacy",
             "--parallelism.expert_parallel_degree", "128", config=config, world_size=256)


@pytest.mark.parametrize(
    "shape, overrides, message",
    [
        ((100, 8, 2, 1024), (), "hidden size 100: HybridEP needs a multiple of 16"),
        ((256, 6, 2, 1024), ("--hybridep.ranks_per_nvlink_domain", "2"),
         "3 local experts x 2 ranks per NVLink domain = 6: HybridEP needs a multiple of 4"),
        ((256, 8, 2, 97), (), "97 tokens per rank per dispatch leave 33 in the last chunk of 64"),
    ],
)
def test_hybridep_library_limits(shape, overrides, message):
    from torchtitan_ext.ep import HybridEPExpertParallel, MoEShape

    job_config = _cluster("--parallelism.expert_parallel_comm_backend", "hybridep", *overrides)
    with pytest.raises(ConfigError, match=message):
        HybridEPExpertParallel._check_library_limits(job_config, MoEShape(*shape))


def test_hybridep_beyond_one_nvlink_domain_needs_the_multinode_build():
    config = "train_configs/deepseek_v3_16b.toml"
    args = ("--parallelism.expert_parallel_comm_backend", "hybridep", "--parallelism.expert_parallel_degree", "16")
    with pytest.raises(ConfigError, match="spans 2 NVLink domains of 8 ranks .* HYBRID_EP_MULTINODE=1"):
        _cluster(*args, config=config, world_size=16)
    _cluster(*args, "--hybridep.multinode_build", config=config, world_size=16)


def test_profiling_on_cpu_is_refused_before_the_first_step():
    """torchtitan 0.2.2's profiler fails on every rank of a CPU job; on CUDA the flag passes through."""
    with pytest.raises(ConfigError) as error:
        _load("--profiling.enable_profiling", device_type="cpu")
    assert str(error.value).startswith("profiling.enable_profiling on CPU: torchtitan 0.2.2's profiler asks")
    assert "unset it on CPU" in str(error.value)
    _load("--profiling.enable_profiling", device_type="cuda")


def test_a_tool_without_a_config_file_takes_the_launchers_job(monkeypatch):
    """As run_train.sh: the arguments' own config file, else $CONFIG_FILE, else the default job."""
    from torchtitan_ext.config import with_config_file

    monkeypatch.delenv("CONFIG_FILE", raising=False)
    assert with_config_file(["--training.steps", "2"]) == [
        "--job.config_file", "train_configs/debug_model.toml", "--training.steps", "2"]
    monkeypatch.setenv("CONFIG_FILE", "train_configs/llama4_debug_model.toml")
    assert with_config_file([])[:2] == ["--job.config_file", "train_configs/llama4_debug_model.toml"]
    assert with_config_file(["--job.config_file=a.toml"]) == ["--job.config_file=a.toml"]
