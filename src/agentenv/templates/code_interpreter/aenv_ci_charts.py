"""A matplotlib figure described as the e2b-code-interpreter SDK's ``Chart`` types.

``figure_to_chart(figure)`` returns the dict the SDK parses (e2b_code_interpreter
``charts``): ``{"type", "title", "elements", ...}`` where the type is ``line``,
``scatter``, ``bar``, ``pie``, ``box_and_whisker``, ``superchart`` (a figure with
several axes: one chart per axes) or ``unknown``; 2-D charts carry their axis
labels and units (``"Time (s)"`` -> unit ``s``), line and scatter charts their
ticks, tick labels and scales (linear, log, ..., ``datetime``, ``categorical``).

What an axes holds decides its type: only lines -> line; only scatter
collections -> scatter; bar containers -> bar; only wedges -> pie; box patches
(``boxplot(patch_artist=True)``) with their lines -> box and whisker. Grid lines
are not data.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

from matplotlib.axes import Axes
from matplotlib.collections import PathCollection
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import PathPatch, Rectangle, Wedge

_UNIT = re.compile(r"\(([^()]*)\)|\[([^\[\]]*)\]")


def figure_to_chart(figure: Figure) -> dict[str, Any] | None:
    axes = figure.get_axes()
    if not any(ax.has_data() for ax in axes):
        return None  # an empty figure is no chart
    if len(axes) == 1:
        return axes_to_chart(axes[0])
    suptitle = figure._suptitle.get_text() if figure._suptitle is not None else ""
    return {"type": "superchart", "title": suptitle or None,
            "elements": [axes_to_chart(ax) for ax in axes]}


def axes_to_chart(ax: Axes) -> dict[str, Any]:
    kind = _kind(ax)
    chart: dict[str, Any] = {"type": kind, "title": ax.get_title() or None, "elements": []}
    if kind == "pie":
        chart["elements"] = [{"label": w.get_label(), "angle": _rounded(w.theta2 - w.theta1),
                              "radius": _rounded(w.r)} for w in ax.patches if isinstance(w, Wedge)]
        return chart
    if kind == "unknown":
        return chart
    chart.update(_labels(ax))
    if kind in ("line", "scatter"):
        chart.update(_axis(ax, "x"))
        chart.update(_axis(ax, "y"))
        chart["elements"] = _lines(ax) if kind == "line" else _scatters(ax)
    elif kind == "bar":
        chart["elements"] = _bars(ax, chart)
    elif kind == "box_and_whisker":
        chart["elements"] = _boxes(ax, chart)
    return chart


# -- what an axes is -----------------------------------------------------------------

def _is_grid(line: Line2D) -> bool:
    ax = line.axes
    return ax is not None and (line in ax.xaxis.get_gridlines()
                               or line in ax.yaxis.get_gridlines())


def _data_lines(ax: Axes) -> list[Line2D]:
    return [line for line in ax.lines if not _is_grid(line)]


def _kind(ax: Axes) -> str:
    lines = _data_lines(ax)
    patches, collections = list(ax.patches), list(ax.collections)
    if any(isinstance(c, BarContainer) for c in ax.containers) and not collections:
        return "bar"
    if patches and all(isinstance(p, Wedge) for p in patches) and not lines and not collections:
        return "pie"
    if patches and all(isinstance(p, PathPatch) for p in patches) and not collections:
        return "box_and_whisker"
    if patches:
        return "unknown"
    if collections and all(isinstance(c, PathCollection) for c in collections) and not lines:
        return "scatter"
    if lines and not collections:
        return "line"
    return "unknown"


# -- labels, axes, values -------------------------------------------------------------

def _labels(ax: Axes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for axis, text in (("x", ax.get_xlabel()), ("y", ax.get_ylabel())):
        out[f"{axis}_label"] = text or None
        found = _UNIT.findall(text or "")
        out[f"{axis}_unit"] = (found[-1][0] or found[-1][1]) if found else None
    return out


def _converter(axis: Any) -> Any:
    get = getattr(axis, "get_converter", None)
    return get() if get is not None else axis.converter


def _axis(ax: Axes, name: str) -> dict[str, Any]:
    axis = ax.xaxis if name == "x" else ax.yaxis
    converter = _converter(axis)
    module = type(converter).__module__ if converter is not None else ""
    ticks = list(axis.get_ticklocs())
    labels = [t.get_text() for t in axis.get_ticklabels()]
    if module == "matplotlib.dates":
        from matplotlib.dates import num2date

        scale = "datetime"
        tick_values: list[Any] = [num2date(t).isoformat() for t in ticks]
    else:
        scale = "categorical" if module == "matplotlib.category" else axis.get_scale()
        tick_values = [_num(t) for t in ticks]
    return {f"{name}_ticks": tick_values, f"{name}_tick_labels": labels, f"{name}_scale": scale}


def _num(value: Any) -> Any:
    """A JSON value for a data point: numbers as float, dates as ISO text."""
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    kind = getattr(value, "dtype", None)
    if kind is not None and kind.kind == "M":  # numpy datetime64
        return str(value.astype("datetime64[s]"))
    if isinstance(value, str):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _rounded(value: Any) -> float:
    """A computed value to 10 significant digits: a pie's 90% wedge is 324 degrees, not
    the 323.99999999999994 its float angles subtract to (E2B's extractor rounds too)."""
    return float(f"{float(value):.10g}")


def _default_label(label: str, prefix: str, index: int) -> str:
    """matplotlib's unnamed artists are ``_childN`` / ``_containerN``: call them
    ``Line N`` / ``Group N``."""
    if not label.startswith("_"):
        return label
    number = re.search(r"(\d+)$", label)
    return f"{prefix} {number.group(1) if number else index}"


def _lines(ax: Axes) -> list[dict[str, Any]]:
    return [{"label": _default_label(str(line.get_label()), "Line", i),
             "points": [[_num(x), _num(y)] for x, y in
                        zip(line.get_xdata(orig=True), line.get_ydata(orig=True), strict=False)]}
            for i, line in enumerate(_data_lines(ax))]


def _scatters(ax: Axes) -> list[dict[str, Any]]:
    return [{"label": _default_label(str(c.get_label()), "Series", i),
             "points": [[_num(x), _num(y)] for x, y in c.get_offsets()]}
            for i, c in enumerate(ax.collections)]


def _tick_label_at(axis: Any, position: float) -> str:
    """The label of the tick at ``position`` (a bar's centre), else the position."""
    for tick, text in zip(axis.get_ticklocs(), axis.get_ticklabels(), strict=False):
        if abs(tick - position) < 1e-6 and text.get_text():
            return str(text.get_text())
    return f"{position:g}"


def _bars(ax: Axes, chart: dict[str, Any]) -> list[dict[str, Any]]:
    elements = []
    horizontal = False
    for index, container in enumerate(c for c in ax.containers if isinstance(c, BarContainer)):
        group = _default_label(str(container.get_label()), "Group", index)
        horizontal = getattr(container, "orientation", "vertical") == "horizontal"
        for rect in container:
            if not isinstance(rect, Rectangle):
                continue
            if horizontal:
                label = _tick_label_at(ax.yaxis, rect.get_y() + rect.get_height() / 2)
                value = rect.get_width()
            else:
                label = _tick_label_at(ax.xaxis, rect.get_x() + rect.get_width() / 2)
                value = rect.get_height()
            elements.append({"label": label, "group": group, "value": _num(value)})
    if horizontal:  # the categories are on y: say so as for vertical bars
        _swap_axes(chart)
    return elements


def _swap_axes(chart: dict[str, Any]) -> None:
    chart["x_label"], chart["y_label"] = chart["y_label"], chart["x_label"]
    chart["x_unit"], chart["y_unit"] = chart["y_unit"], chart["x_unit"]


def _boxes(ax: Axes, chart: dict[str, Any]) -> list[dict[str, Any]]:
    lines = _data_lines(ax)
    elements = []
    vertical = True
    for patch in ax.patches:
        vertices = patch.get_path().vertices
        xs, ys = vertices[:, 0], vertices[:, 1]
        vertical = _has_whisker(lines, xs, ys) or not _has_whisker(lines, ys, xs, swap=True)
        if vertical:
            stats = _box_stats(lines, xs, ys)
            label = _tick_label_at(ax.xaxis, (xs.min() + xs.max()) / 2)
        else:
            stats = _box_stats(lines, ys, xs, swap=True)
            label = _tick_label_at(ax.yaxis, (ys.min() + ys.max()) / 2)
        elements.append({"label": label, **stats})
    if not vertical:
        _swap_axes(chart)
    return elements


def _xy(line: Line2D, swap: bool) -> tuple[list[float], list[float]]:
    xs = [float(v) for v in line.get_xdata()]
    ys = [float(v) for v in line.get_ydata()]
    return (ys, xs) if swap else (xs, ys)


def _has_whisker(lines: list[Line2D], across: Any, along: Any, swap: bool = False) -> bool:
    centre = (across.min() + across.max()) / 2
    for line in lines:
        xs, ys = _xy(line, swap)
        if len(xs) == 2 and all(abs(x - centre) < 1e-9 for x in xs) and ys[0] != ys[1]:
            return True
    return False


def _box_stats(lines: list[Line2D], across: Any, along: Any, swap: bool = False) -> dict[str, Any]:
    """A box's quartiles are its patch's extent along the value axis; its whiskers
    are the lines on its centre line that leave the box, its median the line across
    it, its outliers the markers-only line on its centre."""
    low, high = float(along.min()), float(along.max())
    left, right = float(across.min()), float(across.max())
    centre = (left + right) / 2
    minimum, maximum, median = low, high, (low + high) / 2
    outliers: list[float] = []
    for line in lines:
        xs, ys = _xy(line, swap)
        if not xs:
            continue
        on_centre = all(abs(x - centre) < 1e-9 for x in xs)
        if on_centre and line.get_linestyle() in ("None", "", " ") and line.get_marker():
            outliers = [float(y) for y in ys]
        elif on_centre and len(ys) == 2 and ys[0] != ys[1]:
            minimum, maximum = min(minimum, *ys), max(maximum, *ys)
        elif (len(ys) == 2 and ys[0] == ys[1] and low <= ys[0] <= high
              and min(xs) >= left - 1e-9 and max(xs) <= right + 1e-9
              and max(xs) - min(xs) > 0 and abs(min(xs) - left) + abs(max(xs) - right) < 1e-6):
            median = ys[0]
    return {"min": _rounded(minimum), "first_quartile": _rounded(low),
            "median": _rounded(median), "third_quartile": _rounded(high),
            "max": _rounded(maximum), "outliers": [_rounded(v) for v in outliers]}
