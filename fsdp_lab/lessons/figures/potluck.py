"""Chapter 00's picture of the potluck: every household's fridge and the long table, from real parameter counts."""
from __future__ import annotations

import matplotlib.pyplot as plt

from fsdp_lab.lessons.figures.common import show

UNIT_COLOURS = ("#60a5fa", "#f97316", "#a855f7", "#facc15", "#34d399")
ROOT_COLOUR = "#34d399"


def potluck_picture(shards: dict, world_size: int, served: str = "blocks.0", title: str = "") -> None:
    """Each household's fridge (its shard of every unit) and the long table with the root and one block served,
    assembled from every household's share. `shards`: unit → elements of one rank's shard."""
    colours = {name: ROOT_COLOUR if name == "<root>" else UNIT_COLOURS[i % len(UNIT_COLOURS)]
               for i, name in enumerate(shards)}
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for y in range(world_size):
        left = 0
        for name, size in shards.items():
            ax.barh(y, size / 1e3, left=left / 1e3, color=colours[name], edgecolor="white",
                    label=name if y == 0 else None)
            left += size
    left = 0
    for name in ("<root>", served):
        for r in range(world_size):  # each household brings its share to the table
            ax.barh(world_size, shards[name] / 1e3, left=left / 1e3, color=colours[name], edgecolor="white",
                    hatch="//" if r else None)
            left += shards[name]
    rows = [f"household {r}'s fridge\n(rank {r}'s shard)" for r in range(world_size)]
    ax.set_yticks(range(world_size + 1), rows + [f"long table\n({served} served)"])
    ax.invert_yaxis()
    ax.set_xlabel("parameters (thousands)")
    ax.set_ylabel("place (fridge or table)")
    ax.barh(0, 0, color="white", edgecolor="grey", hatch="//", label="brought by the other households")
    ax.set_title(title or f"The potluck on {world_size} ranks")
    ax.legend(title="unit (dish)", loc="center left", bbox_to_anchor=(1.01, 0.5))
    show(fig)
