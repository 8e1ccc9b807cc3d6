"""What every chapter figure shares: how it is shown (inline, then closed, so pyplot keeps no figure around)."""
from __future__ import annotations

import matplotlib.pyplot as plt


def show(fig, rect=None) -> None:
    """Lay out, show inline and close: a figure is drawn once and never accumulates in pyplot's state."""
    if rect is None:
        fig.tight_layout()
    else:
        fig.tight_layout(rect=rect)
    plt.show()
    plt.close(fig)
