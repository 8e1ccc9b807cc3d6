"""Figure of chapter 06c: who owns which slice of each weight under tensor parallel then fully_shard on a 2-D
mesh, drawn from what the live ranks read off their numbered weights (fsdp_lab.lessons.experiments.composing)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from fsdp_lab.lessons.figures.common import show
from fsdp_lab.lessons.figures.granularity import RANK_COLOURS


def slice_owners(owners: list, names=("layers.0.w1.weight", "layers.0.w2.weight")) -> None:
    """One panel per weight in `names`: its (rows, columns) grid, each element coloured by the rank whose local
    tensor holds it. `owners`: every rank's composing.owned(model), in rank order."""
    fig, axes = plt.subplots(1, len(names), figsize=(3.8 * len(names), 4.0))
    for ax, name in zip(np.atleast_1d(axes), names):
        rows, cols = owners[0][name]["shape"]
        grid = np.full(rows * cols, -1)
        for rank, owned in enumerate(owners):
            grid[owned[name]["indices"]] = rank
        colours = np.array([plt.matplotlib.colors.to_rgb(RANK_COLOURS[r]) for r in range(len(owners))])
        ax.imshow(colours[grid.reshape(rows, cols)], interpolation="nearest")
        ax.set_title(f"{name}\n({', '.join(owners[0][name]['placements'])}) on {owners[0][name]['mesh_dims']}",
                     fontsize=9)
        ax.set_xlabel("column (element index)")
        ax.set_ylabel("row (element index)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=RANK_COLOURS[r]) for r in range(len(owners))]
    fig.legend(handles, [f"rank {r}" for r in range(len(owners))], loc="lower center", ncol=len(owners))
    show(fig, rect=(0, 0.08, 1, 1))
