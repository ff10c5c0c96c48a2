"""`kvxfer bench --plot`: the title names the process count, the caption says what the backend's
cost per descriptor means for the layouts, the spread is drawn, and nothing is cut at an edge."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvxfer.cli.bench import caption, plot, processes

pytest.importorskip("matplotlib")


def _rows(gbps: dict[str, list[float]]) -> list[dict[str, Any]]:
    out = []
    for layout, values in gbps.items():
        for tokens, g in zip((256, 1024, 4096), values):
            n = 1_000_000 * tokens
            descs = tokens // 64 * (61 if layout.startswith("layers") else 1)
            out.append({"layout": layout, "tokens": tokens, "bytes": n, "descriptors": descs, "gbps": g,
                        "min_seconds": n / (g * 1.5) / 1e9, "max_seconds": n / (g * 0.5) / 1e9})
    return out


def test_title_says_processes_in_words() -> None:
    assert processes(1) == "1 process" and processes(2) == "2 processes"


def test_caption_explains_the_layouts_from_the_rows() -> None:
    rows = _rows({"packed:packed": [5, 6, 8], "layers:packed": [1, 1.5, 2]})
    text = caption(rows, "nixl")
    assert text.startswith("At 4,096 tokens, layers:packed carries 61x the descriptors of packed:packed and moves "
                           "at 0.25x its GB/s")
    assert "pays per descriptor" in text and "moved slower" in text and "min to max" in text
    same = caption(_rows({"packed:packed": [8, 8, 8], "layers:packed": [8, 8, 8]}), "loopback")
    assert "1.00x its GB/s" in same and "memmove" in same  # why loopback shows no difference


@pytest.mark.parametrize("layers, says, never", [
    ([1, 1.5, 2], "moved slower", "faster"),           # 0.25x: the per-descriptor cost shows
    ([5, 6, 8.2], "little or nothing", "moved slower"),  # 1.02x: it does not, and the caption must not claim it
    ([5, 6, 12], "moved faster here", "moved slower"),   # 1.50x
])
def test_caption_follows_its_own_numbers(layers: list[float], says: str, never: str) -> None:
    """Issue 33: a fixed "fewer descriptors move faster" sat under a run that showed otherwise. The
    first case is the control: the same rows shape with a real slowdown still gets that sentence."""
    text = caption(_rows({"packed:packed": [5, 6, 8], "layers:packed": layers}), "nixl")
    assert says in text and never not in text, text
    assert f"moves at {layers[-1] / 8:.2f}x its GB/s" in text


def test_plot_draws_spread_with_room_above_the_top_marker(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = _rows({"packed:packed": [5, 6, 8], "layers:packed": [1, 1.5, 2]})
    seen: dict[str, Any] = {}
    real_savefig = plt.Figure.savefig

    def keep(fig: Any, path: Any, **kw: Any) -> None:
        seen["fig"] = fig
        real_savefig(fig, path, **kw)

    plt.Figure.savefig = keep  # type: ignore[method-assign]
    try:
        plot(rows, str(tmp_path / "p.png"), title="t", note=caption(rows, "nixl"))
    finally:
        plt.Figure.savefig = real_savefig  # type: ignore[method-assign]
    assert (tmp_path / "p.png").stat().st_size > 10_000
    ax_bw = seen["fig"].axes[0]
    top = max(r["bytes"] / r["min_seconds"] / 1e9 for r in rows)  # the highest bar end
    assert ax_bw.get_ylim()[1] > top and ax_bw.get_ylim()[0] == 0
    assert ax_bw.containers, "min-max error bars are drawn"
    assert any("At 4,096 tokens" in t.get_text() for t in seen["fig"].texts)
