"""Plots of saved routing statistics (``python -m torchtitan_ext.routing_report`` draws them):

- ``expert_load.png``: per MoE layer, a heatmap of each expert's share of the
  layer's routed tokens over the training steps (1/E is perfect balance);
- ``coactivation_layer<L>.png``: for one layer (``--layer``, default the most
  imbalanced), how often two experts are picked by the same token, as a share
  of the tokens routed to the row's expert.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def expert_load_figure(stats):
    counts = stats["tokens_per_expert"].astype(np.float64)  # [S, L, E]
    shares = counts / np.maximum(counts.sum(axis=2, keepdims=True), 1)
    layers = stats["layers"]
    num_experts = counts.shape[2]
    columns = min(4, len(layers))
    rows = -(-len(layers) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3 * rows), squeeze=False)
    for index, layer in enumerate(layers):
        axis = axes[index // columns][index % columns]
        image = axis.imshow(
            shares[:, index].T, aspect="auto", origin="lower", cmap="viridis",
            vmin=0, vmax=max(2.0 / num_experts, shares[:, index].max()),
            extent=(stats["steps"][0] - 0.5, stats["steps"][-1] + 0.5, -0.5, num_experts - 0.5),
        )
        axis.set_title(f"layer {layer}")
        axis.set_xlabel("step")
        axis.set_ylabel("expert")
        figure.colorbar(image, ax=axis, label="share of routed tokens")
    for index in range(len(layers), rows * columns):
        axes[index // columns][index % columns].axis("off")
    figure.suptitle(f"Expert load over steps (balanced share = 1/{num_experts} = {1 / num_experts:.3f})")
    figure.tight_layout()
    return figure


def most_imbalanced_layer(stats) -> int:
    totals = stats["tokens_per_expert"].sum(axis=0)  # [L, E]
    imbalance = totals.max(axis=1) / np.maximum(totals.mean(axis=1), 1)
    return int(stats["layers"][int(np.argmax(imbalance))])


def coactivation_figure(stats, layer: int):
    index = int(np.flatnonzero(stats["layers"] == layer)[0])
    matrix = stats["coactivation"][index].astype(np.float64)
    conditional = matrix / np.maximum(matrix.diagonal()[:, None], 1)
    figure, axis = plt.subplots(figsize=(6, 5))
    image = axis.imshow(conditional, cmap="magma", vmin=0, vmax=1)
    axis.set_title(f"Top-{int(stats['top_k'])} co-activation, layer {layer}")
    axis.set_xlabel("expert b")
    axis.set_ylabel("expert a")
    figure.colorbar(image, ax=axis, label="P(b picked | a picked)")
    figure.tight_layout()
    return figure


def write_report(stats, out: Path, layer: int) -> list[Path]:
    """Both figures of ``stats`` (a loaded dump) into ``out``, the co-activation one for MoE layer ``layer``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in (
        ("expert_load.png", expert_load_figure(stats)),
        (f"coactivation_layer{layer}.png", coactivation_figure(stats, layer)),
    ):
        figure.savefig(out / name, dpi=110)
        plt.close(figure)
        written.append(out / name)
    return written
