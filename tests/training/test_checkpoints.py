"""Checkpoints are counted, loaded and reported only once complete on disk (torchtitan_ext.training.checkpoints)."""

import queue
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchtitan_ext.config import ConfigError, load_job_config
from torchtitan_ext.training import checkpoints
from torchtitan_ext.training.specs import register_train_specs


def _folder(tmp_path: Path, complete: list[int], torn: list[int]) -> Path:
    folder = tmp_path / "checkpoint"
    for step in complete + torn:
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / "__0_0.distcp").write_bytes(b"x")
    for step in complete:
        (folder / f"step-{step}" / ".metadata").write_bytes(b"x")
    return folder


def _purged(folder: Path, keep: int) -> list[str]:
    checkpointer = SimpleNamespace(folder=str(folder), keep_latest_k=keep, purge_queue=queue.Queue())
    checkpoints.purge_keeping_complete(checkpointer)
    return sorted(Path(checkpointer.purge_queue.get_nowait()).name for _ in range(checkpointer.purge_queue.qsize()))


def test_torn_folders_are_set_aside_and_never_counted(tmp_path):
    """Complete 4, 6, 8 and a torn 7, keep_latest_k = 2: torchtitan's own purge deleted 4 and 6 (it counts
    7); here 7 is set aside at start and only 4 goes."""
    folder = _folder(tmp_path, complete=[4, 6, 8], torn=[7])
    moved = checkpoints.set_aside_torn(folder)
    assert moved == [folder / "incomplete_step_7"]
    assert sorted(p.name for p in folder.iterdir()) == ["incomplete_step_7", "step-4", "step-6", "step-8"]
    assert _purged(folder, keep=2) == ["step-4"]


def test_a_write_in_flight_does_not_push_a_complete_checkpoint_out(tmp_path):
    """Async mode purges while the newest write (step 8, no .metadata yet) is in flight: 4 and 6 stay,
    so a crash now still leaves two complete checkpoints."""
    folder = _folder(tmp_path, complete=[4, 6], torn=[8])
    assert _purged(folder, keep=2) == []
    (folder / "step-8" / ".metadata").write_bytes(b"x")
    assert _purged(folder, keep=2) == ["step-4"]


def test_set_aside_names_never_collide(tmp_path):
    folder = _folder(tmp_path, complete=[], torn=[3])
    (folder / "incomplete_step_3").mkdir()
    assert checkpoints.set_aside_torn(folder) == [folder / "incomplete_step_3_2"]


def test_an_hf_export_of_the_last_step_is_set_aside_as_such(tmp_path, caplog):
    """last_save_in_hf writes the last step as HF safetensors, no .metadata: torchtitan would load it as the latest
    checkpoint and fail; it is set aside under its own name, not called an interrupted write."""
    folder = _folder(tmp_path, complete=[2], torn=[4, 6])
    for step in (4, 6):
        (folder / f"step-{step}" / "model.safetensors").write_bytes(b"x")
    (folder / "step-4" / checkpoints.HF_EXPORT_INDEX).write_text('{"weight_map": {"w": "model.safetensors"}}')
    (folder / "step-6" / checkpoints.HF_EXPORT_INDEX).write_text('{"weight_map": {"w": "model.saf')  # cut short
    assert checkpoints.set_aside_torn(folder) == [folder / "hf_export_step_4", folder / "incomplete_step_6"]
    assert (folder / "hf_export_step_4" / checkpoints.HF_EXPORT_INDEX).is_file()
    assert [r.getMessage() for r in caplog.records if "step-4 is" in r.getMessage()] == [
        f"Checkpoint {folder / 'step-4'} is an HF safetensors export (checkpoint.last_save_in_hf saves a job's last "
        f"step so), which a resume cannot load; set aside as {folder / 'hf_export_step_4'}, never loaded or counted; "
        "training resumes from step 2"]


@pytest.mark.parametrize("config, left_out", [
    ("debug_model.toml", None),  # DeepSeek-V3's HF format keeps it, as e_score_correction_bias
    ("llama4_debug_model.toml", "layers.1.moe.expert_bias"),
    ("qwen3_moe_debug_model.toml", "layers.0.moe.expert_bias"),
    ("gpt_oss_debug_model.toml", "layers.0.moe.expert_bias"),
])
def test_an_hf_export_that_leaves_out_the_routing_bias_is_named(config, left_out):
    """torchtitan's own HF state-dict adapters of the four models, on their debug models' state dicts."""
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_ext.config import model_args_of

    register_train_specs()
    job_config = load_job_config(["--job.config_file", f"train_configs/{config}"], "cpu", 2)
    adapter = get_train_spec(job_config.model.name).state_dict_adapter(model_args_of(job_config), None)
    assert checkpoints.routing_bias_left_out_of_hf(job_config, adapter) == left_out


def test_an_hf_export_of_the_whole_training_state_is_refused_before_any_process():
    """torchtitan exports the model alone as HF safetensors, and asserts so at the last step, after the run."""
    register_train_specs()
    with pytest.raises(ConfigError, match=r"^checkpoint.last_save_in_hf saves the model alone, but "
                                          r"checkpoint.last_save_model_only is off: drop "):
        load_job_config(["--job.config_file", "train_configs/debug_model.toml", "--checkpoint.enable",
                         "--checkpoint.last_save_in_hf", "--checkpoint.no_last_save_model_only"], "cpu", 2)


def test_keep_latest_k_of_one_is_refused_before_any_process():
    register_train_specs()
    with pytest.raises(ConfigError, match=r"checkpoint.keep_latest_k = 1: torchtitan keeps at least 2"):
        load_job_config(["--job.config_file", "train_configs/debug_model.toml", "--checkpoint.keep_latest_k", "1"], "cpu", 2)
