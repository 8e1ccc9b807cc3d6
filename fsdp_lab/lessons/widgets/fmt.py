"""Small formatting helpers shared by the widgets (binary units: KiB = 1024 bytes)."""
from __future__ import annotations

import html

MEMORY_KINDS = (  # (key in the trace's "mem" record, label, colour)
    ("params_sharded", "params, sharded (fp32 shard)", "#60a5fa"),
    ("params_unsharded", "params, gathered (on the table)", "#1d4ed8"),
    ("grads_sharded", "grads, sharded", "#f97316"),
    ("grads_unsharded", "grads, unsharded", "#9a3412"),
    ("optimizer_state", "optimizer state (AdamW)", "#34d399"),
)


def human_bytes(n: float) -> str:
    """1536 → '1.5 KiB'. Exact below 1 KiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def say(text: str, width: int = 108, indent: str = "   ") -> None:
    """Print a long line wrapped between words (a notebook wraps a long output line mid-word)."""
    import textwrap

    print(textwrap.fill(text, width=width, subsequent_indent=indent, break_long_words=False,
                        break_on_hyphens=False))


def esc(text) -> str:
    return html.escape(str(text), quote=True)


def memory_total(mem: dict) -> int:
    """Bytes to plot for one trace record: the allocator's count on CUDA, else the runtime's exact count."""
    if "cuda_allocated" in mem:
        return int(mem["cuda_allocated"])
    return int(mem.get("total", sum(mem.get(k, 0) for k, _, _ in MEMORY_KINDS)))


def figure_png(fig) -> bytes:
    """A matplotlib Figure as PNG bytes, drawn with the Agg canvas (no pyplot state)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


def show_figure(out, fig) -> None:
    """Put a matplotlib Figure into an Output widget as its only output (a PNG). Safe from any thread: it sets
    the widget's outputs instead of capturing display() calls, and it never touches pyplot's global figures."""
    import base64

    image = base64.b64encode(figure_png(fig)).decode("ascii")
    out.outputs = ({"output_type": "display_data", "metadata": {},
                    "data": {"image/png": image, "text/plain": "<matplotlib figure>"}},)
