"""The placement tool on a DeepSeek-V3 671B-shaped synthetic skew: its runtime and what it buys.

    python -m torchtitan_ext.bench placement [--steps 8] [--tokens 4096] [--ranks-per-domain 16]

Writes a routing-statistics dump of the 671B model's shape (58 MoE layers,
256 experts, top-8) whose routing is skewed (Zipf popularity over experts) and
clustered (each token picks mostly within one of 32 groups of 8 co-activated
experts, groups differing per layer), in 2 files, then runs
``python -m torchtitan_ext.placement`` for EP=64 with 4 NVLink domains of 16
ranks on it and prints the tool's report and its wall time.
"""

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from torchtitan_ext.bench import ROOT
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.jobs import run_job

EXPERTS, TOP_K, GROUP = 256, 8, 8
MOE_LAYERS = list(range(3, 61))


def layer_model(rng, experts: int, group: int, skew: float) -> tuple[np.ndarray, np.ndarray]:
    """(popularity, group of each expert) of one layer: Zipf popularity, random groups of ``group`` experts."""
    popularity = 1.0 / np.arange(1, experts + 1)[rng.permutation(experts)] ** skew
    return popularity, rng.permutation(experts) // group


def layer_routing(rng, tokens: int, top_k: int, popularity: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """[tokens, top_k] expert ids: a token's group drawn by popularity, each in-group expert 40x as likely."""
    group_weight = np.bincount(groups, weights=popularity)
    chosen = rng.choice(len(group_weight), size=tokens, p=group_weight / group_weight.sum())
    weight = np.log(popularity)[None, :] + np.where(groups[None, :] == chosen[:, None], np.log(40.0), 0.0)
    scores = weight + rng.gumbel(size=(tokens, len(popularity)))
    return np.argpartition(-scores, top_k, axis=1)[:, :top_k]


def write_dump(folder: Path, steps: int, tokens: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    layers = [layer_model(rng, EXPERTS, GROUP, skew=0.8) for _ in MOE_LAYERS]
    files = np.array_split(np.arange(1, steps + 1), 2)
    for file_steps in files:
        counts = np.zeros((len(file_steps), len(MOE_LAYERS), EXPERTS), dtype=np.int64)
        coactivation = np.zeros((len(MOE_LAYERS), EXPERTS, EXPERTS), dtype=np.int64)
        sampled = np.zeros((len(file_steps), len(MOE_LAYERS), tokens, TOP_K), dtype=np.int16)
        for i, _ in enumerate(tqdm(file_steps, desc=f"synthetic steps {file_steps[0]}-{file_steps[-1]}", unit="step")):
            for layer in range(len(MOE_LAYERS)):
                ids = layer_routing(rng, tokens, TOP_K, *layers[layer])
                picks = np.zeros((tokens, EXPERTS), dtype=np.float32)
                np.put_along_axis(picks, ids, 1.0, axis=1)
                counts[i, layer] = picks.sum(axis=0)
                coactivation[layer] += (picks.T @ picks).astype(np.int64)
                sampled[i, layer] = ids
        np.savez(
            folder / f"routing_step{file_steps[0]:06d}-{file_steps[-1]:06d}.npz",
            steps=file_steps, layers=np.array(MOE_LAYERS), tokens_per_expert=counts, coactivation=coactivation,
            transitions=np.zeros_like(coactivation), top_k=np.array(TOP_K), sampled_expert_ids=sampled,
        )


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8, help="steps in the dump (half fit, half held out)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step and layer")
    parser.add_argument("--ranks-per-domain", type=int, default=16, help="EP ranks per NVLink domain")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        write_dump(Path(tmp), args.steps, args.tokens)
        command = [
            sys.executable, "-m", "torchtitan_ext.placement", "--routing-stats", tmp,
            "--job.config_file", "train_configs/deepseek_v3_671b_gb200.toml", "--world-size", "256",
            "--ranks-per-domain", str(args.ranks_per_domain), "-o", str(Path(tmp) / "placement.json"),
        ]
        print("$ python", " ".join(command[1:]).replace(tmp, "<synthetic dump>"))
        began = time.perf_counter()
        result = run_job(command, cwd=ROOT, timeout_s=1800)
        wall = time.perf_counter() - began
    # the placement file went with the temporary folder: its "Wrote ..." line is left out
    report = [line for line in result.output.splitlines() if not line.startswith("Wrote ")]
    print("\n".join(report[:2] + report[-1:]))
    print(f"tool wall time (process, including imports and the job config): {wall:.1f} s")
    return result.returncode
