"""Routing statistics: exact counts and samples, the cross-rank sum, the file schema, the plots."""

import numpy as np
import pytest
import torch

from tests.helpers import run_distributed
from torchtitan_ext.balancing.routing_stats import load, load_folder, RoutingRecorder
from torchtitan_ext.config import ConfigError
from torchtitan_ext import routing_report

E = 4


def _recorder(num_layers=4, sample_tokens=2):
    recorder = RoutingRecorder(
        num_layers=num_layers, num_experts=E, top_k=2, device=torch.device("cpu"), sample_tokens=sample_tokens
    )
    recorder.moe_layers = {1, 2, 3}
    recorder._next_layer = {1: 2, 2: 3}
    return recorder


def test_exact_counts_on_hand_built_routing(tmp_path):
    recorder = _recorder()
    layer1 = torch.tensor([[0, 1], [0, 2], [3, 0]])
    layer2 = torch.tensor([[1, 2], [2, 3], [1, 0]])
    layer3 = torch.tensor([[3, 2], [3, 1], [3, 0]])
    for layer, ids in ((1, layer1), (2, layer2), (3, layer3)):
        recorder.observe(layer, ids)
    recorder.end_step(5)
    recorder.observe(1, torch.tensor([[2, 3]]))
    recorder.end_step(6)
    data = load(recorder.save(tmp_path))

    assert data["steps"].tolist() == [5, 6]
    assert data["layers"].tolist() == [1, 2, 3]
    assert data["tokens_per_expert"][0].tolist() == [[3, 1, 1, 1], [1, 2, 2, 1], [1, 1, 1, 3]]
    assert data["tokens_per_expert"][1].tolist() == [[0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
    # layer 1: tokens {0,1}, {0,2}, {3,0} in step 5 and {2,3} in step 6
    assert data["coactivation"][0].tolist() == [
        [3, 1, 1, 1],
        [1, 1, 0, 0],
        [1, 0, 2, 1],
        [1, 0, 1, 2],
    ]
    # layer 1 -> 2, token by token: {0,1}x{1,2}, {0,2}x{2,3}, {3,0}x{1,0}
    expected = np.zeros((E, E), dtype=np.int64)
    for before, after in zip(layer1.tolist(), layer2.tolist()):
        for a in before:
            for b in after:
                expected[a, b] += 1
    assert data["transitions"][0].tolist() == expected.tolist()
    assert data["transitions"][0].sum() == 3 * 2 * 2
    assert data["transitions"][2].sum() == 0, "the last MoE layer has no successor"
    assert int(data["top_k"]) == 2
    # the first 2 tokens per step and layer, -1 where a step had fewer
    assert data["sampled_expert_ids"].dtype == np.int16
    assert data["sampled_expert_ids"][0].tolist() == [[[0, 1], [0, 2]], [[1, 2], [2, 3]], [[3, 2], [3, 1]]]
    assert data["sampled_expert_ids"][1].tolist() == [[[2, 3], [-1, -1]], [[-1, -1], [-1, -1]], [[-1, -1], [-1, -1]]]


def test_only_consecutive_layers_of_one_forward_chain():
    recorder = _recorder()
    recorder.observe(2, torch.tensor([[0, 1]]))
    recorder.observe(1, torch.tensor([[2, 3]]))  # a new forward starts: no 2 -> 1 transition
    recorder.observe(3, torch.tensor([[0, 1]]))  # 1 -> 3 skips layer 2: not a transition
    assert recorder.transitions.sum() == 0


def _half_batch_worker(rank, world_size, folder):
    recorder = _recorder(sample_tokens=4)
    generator = torch.Generator().manual_seed(0)
    for step in (1, 2):
        batches = [torch.randint(0, E, (8, 2), generator=generator) for _ in range(3)]  # layers 1..3
        for layer, ids in zip((1, 2, 3), batches):
            recorder.observe(layer, ids[rank * 4 : (rank + 1) * 4])
        recorder.end_step(step)
    return recorder.save(folder)


@pytest.mark.slow
def test_sum_over_ranks_equals_one_process_seeing_both_halves(tmp_path):
    paths = run_distributed(2, _half_batch_worker, str(tmp_path / "two"))
    assert paths[1] is None, "only rank 0 writes"
    two_ranks = load(paths[0])

    recorder = _recorder(sample_tokens=8)  # rank-major samples: rank 0's 4 tokens, then rank 1's
    generator = torch.Generator().manual_seed(0)
    for step in (1, 2):
        batches = [torch.randint(0, E, (8, 2), generator=generator) for _ in range(3)]
        for layer, ids in zip((1, 2, 3), batches):
            recorder.observe(layer, ids)
        recorder.end_step(step)
    one_rank = load(recorder.save(tmp_path / "one"))
    for key in one_rank:
        assert np.array_equal(one_rank[key], two_ranks[key]), key


def test_report_writes_plots(tmp_path):
    recorder = _recorder()
    generator = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        for layer in (1, 2, 3):
            recorder.observe(layer, torch.randint(0, E, (16, 2), generator=generator))
        recorder.end_step(step)
    recorder.save(tmp_path)
    written = routing_report.main([str(tmp_path), "--layer", "2"])
    assert [p.name for p in written] == ["expert_load.png", "coactivation_layer2.png"]
    import matplotlib.image

    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = matplotlib.image.imread(path)
        # a drawn figure (dpi 110, several inches a side) with more than a background in it; the
        # byte size checked before depended on the zlib and matplotlib builds
        assert min(pixels.shape[:2]) > 200 and len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 16
    with pytest.raises(SystemExit):
        routing_report.main([str(tmp_path), "--layer", "0"])


def _record(recorder, steps, seed=2):
    generator = torch.Generator().manual_seed(seed)
    for step in steps:
        for layer in (1, 2, 3):
            recorder.observe(layer, torch.randint(0, E, (8, 2), generator=generator))
        recorder.end_step(step)


def test_files_are_named_by_their_steps_and_a_resume_adds_one(tmp_path):
    """Saved every 4 steps, preempted after 6 (saved there), resumed from 6: three files, no step lost or
    written twice. Named by the last step only (as before), the resumed run's steps 7-8 replaced 5-8."""
    first = _recorder()
    _record(first, [1, 2, 3, 4])
    first.save(tmp_path)
    _record(first, [5, 6])
    first.save(tmp_path)  # the save at preemption
    resumed = _recorder()
    _record(resumed, [7, 8], seed=3)
    resumed.save(tmp_path)
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == ["routing_step000001-000004.npz", "routing_step000005-000006.npz", "routing_step000007-000008.npz"]
    assert load_folder(tmp_path)["steps"].tolist() == list(range(1, 9))


def test_a_later_run_sets_aside_what_it_records_again(tmp_path):
    """A second job in the same folder: the first job's files are set aside, not mixed in (before, loading
    gave steps [1..4, 1..5, 7..10] and the placement tool used them). A resume from step 2 of a run
    that recorded 1-4: that file reaches past the checkpoint and is set aside too (a window cannot be split)."""
    first = _recorder()
    _record(first, [1, 2, 3, 4])
    first.save(tmp_path)
    _record(first, [5, 6, 7, 8])
    first.save(tmp_path)
    second = _recorder()
    _record(second, [1, 2, 3], seed=4)
    second.save(tmp_path)
    assert load_folder(tmp_path)["steps"].tolist() == [1, 2, 3]
    assert sorted(path.name for path in tmp_path.glob("superseded_*")) == [
        "superseded_routing_step000001-000004.npz", "superseded_routing_step000005-000008.npz"
    ]
    resumed = _recorder()
    _record(resumed, [3, 4], seed=5)
    resumed.save(tmp_path)
    assert load_folder(tmp_path)["steps"].tolist() == [3, 4]


def test_overlapping_files_are_refused_naming_both(tmp_path):
    for name, steps in (("a", [1, 2, 3, 4]), ("b", [3, 4, 5])):
        recorder = _recorder()
        _record(recorder, steps)
        recorder.save(tmp_path / name)
    for path in (tmp_path / "b").iterdir():
        path.rename(tmp_path / "a" / path.name)
    with pytest.raises(ConfigError, match=r"routing_step000001-000004.npz \(steps 1-4\) and routing_step000003-000005.npz "
                                          r"\(steps 3-5\) overlap: two runs recorded into one folder"):
        load_folder(tmp_path / "a")


def test_a_write_is_whole_or_absent(tmp_path, monkeypatch):
    """A kill during the write leaves the hidden partial file, which no reader lists."""
    recorder = _recorder()
    _record(recorder, [1, 2])

    def killed_mid_write(file, **arrays):
        file.write(b"PK\x03\x04 half an archive")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        recorder.save(tmp_path)
    assert [path.name for path in tmp_path.iterdir()] == [".routing_step000001-000002.npz.partial"]
    with pytest.raises(ConfigError, match="no routing_step"):
        load_folder(tmp_path)


def test_a_truncated_file_is_one_line_naming_it(tmp_path):
    recorder = _recorder()
    _record(recorder, [1, 2])
    path = recorder.save(tmp_path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ConfigError) as error:
        load_folder(tmp_path)
    assert str(error.value).startswith(f"routing statistics file {path} cannot be read (")
    assert "\n" not in str(error.value)
