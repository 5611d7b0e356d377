"""What every chart of the benchmarks does last: lay it out, write it, let it go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["save"]


def save(fig: Any, path: Path | str, dpi: int = 110) -> str:
    """Write ``fig`` (a matplotlib figure) to ``path`` (its folder made if need be), close
    it, and return the line that says where it went."""
    import matplotlib.pyplot as plt

    for ax in fig.axes:  # legends below their plot: inside, they hid the tallest bars
        if ax.get_legend() is not None:
            handles, labels = ax.get_legend_handles_labels()
            ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16),
                      ncol=2, fontsize=7, frameon=False)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return f"chart saved to {path}"
