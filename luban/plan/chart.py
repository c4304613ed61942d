"""PNG chart of the best layouts: per-GPU memory stack and step-time breakdown (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

from luban.plan.estimate import MEMORY_KEYS
from luban.plan.explain import GIB, describe


# bars per chart: the best CHART_ROWS of a search (``--top`` may ask for 10,000, whose chart took 6 minutes
# and was 660,000 pixels tall); 50 rows are 2.2 + 0.6 x 50 inches, 3,500 pixels at 110 dpi
CHART_ROWS = 50


def chart_format(path: "str | Path") -> str:
    """The image format ``path``'s suffix names (no suffix: png); one line (exit 2) for a suffix
    matplotlib cannot write. Called before a search, so a bad name costs nothing."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    from luban.errors import bad_value

    kinds = FigureCanvasBase.get_supported_filetypes()
    kind = Path(path).suffix[1:].lower() or "png"
    if kind not in kinds:
        raise bad_value("--chart", str(path), f"an image file ending in one of {', '.join('.' + k for k in kinds)}")
    return kind


def write_chart(estimates: list, path: "str | Path", title: str = "") -> Path:
    """Two stacked horizontal bar charts, one bar per estimate (best at the top; the first ``CHART_ROWS``)."""
    kind = chart_format(path)
    import matplotlib.pyplot as plt

    estimates = estimates[:CHART_ROWS]
    labels = [describe(e.layout) for e in estimates][::-1]
    rows = list(reversed(estimates))
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(15, 2.2 + 0.6 * len(rows)), sharey=True)
    for ax, keys, values, unit in (
            (ax_mem, MEMORY_KEYS[:-1], lambda e, k: e.memory_bytes[k] / GIB, "GiB per GPU"),
            (ax_time, list(rows[0].time_breakdown_s) if rows else [], lambda e, k: e.time_breakdown_s[k], "seconds per step")):
        left = [0.0] * len(rows)
        for key in keys:
            widths = [values(e, key) for e in rows]
            if any(widths):
                ax.barh(labels, widths, left=left, label=key)
                left = [a + b for a, b in zip(left, widths)]
        ax.set_xlabel(unit)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / max(1, len(rows))), ncol=5)
    if rows:
        ax_mem.axvline(rows[0].hbm_bytes / GIB, color="k", linestyle="--", linewidth=1)
    ax_mem.set_title("memory per GPU (dashed: HBM)")
    ax_time.set_title("step time breakdown")
    ax_mem.tick_params(axis="y", labelsize=7)
    if title:  # plain text: a '$' in a model's or profile's name is not TeX (an unbalanced one was a traceback)
        fig.suptitle(title, parse_math=False)
    import io
    import warnings

    from luban.data.atomic import create_bytes
    from luban.errors import bad_value

    path = Path(path)
    png = io.BytesIO()
    with warnings.catch_warnings():  # a name's CJK or control characters: a box drawn, not matplotlib's warnings
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from", category=UserWarning)
        warnings.filterwarnings("ignore", message=r"Matplotlib currently does not support", category=UserWarning)
        fig.tight_layout()
        fig.savefig(png, dpi=110, format=kind)
    plt.close(fig)
    try:  # whole or not at all, never over an existing file; a folder that refuses the file is one line
        create_bytes(path, png.getvalue())
    except FileExistsError:
        raise bad_value("--chart", str(path), "a new file's path (luban never overwrites a file)") from None
    except OSError as err:
        raise bad_value("--chart", str(path), f"a file path in an existing, writable folder ({err.strerror})") from None
    return path
