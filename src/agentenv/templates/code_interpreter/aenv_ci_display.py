"""IPython extension for the code-interpreter template's Python kernels.

Loaded in every Python kernel (``--IPKernelApp.extra_extensions``). It adds the
result formats E2B's template returns beside the usual MIME types:

* ``e2b/data``: a pandas DataFrame as ``{column: [values]}`` (the SDK's ``data``);
* ``e2b/chart``: a matplotlib figure described as a chart (the SDK's ``chart``,
  see aenv_ci_charts);

and makes Pillow images show as results: ``Image.show()`` and ``Image.save(path)``
display the image (there is no screen in a sandbox).

pandas and matplotlib are imported only when the user's code already has: a
result of ``1 + 1`` costs nothing.
"""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.formatters import BaseFormatter
from traitlets import ObjectName, Unicode


class DataFrameFormatter(BaseFormatter):
    format_type = Unicode("e2b/data")
    print_method = ObjectName("_repr_e2b_data_")
    _return_type = (dict,)

    def __call__(self, obj: Any) -> Any:
        pandas = sys.modules.get("pandas")
        if pandas is None or not isinstance(obj, pandas.DataFrame):
            return super().__call__(obj)
        return {str(column): [_plain(v) for v in values]
                for column, values in obj.to_dict(orient="list").items()}


class ChartFormatter(BaseFormatter):
    format_type = Unicode("e2b/chart")
    print_method = ObjectName("_repr_e2b_chart_")
    _return_type = (dict,)

    def __call__(self, obj: Any) -> Any:
        if "matplotlib" not in sys.modules:
            return super().__call__(obj)
        from matplotlib.figure import Figure

        if not isinstance(obj, Figure):
            return super().__call__(obj)
        import aenv_ci_charts

        try:
            return aenv_ci_charts.figure_to_chart(obj)
        except Exception:  # a figure we cannot read is still shown as an image
            return None


def _plain(value: Any) -> Any:
    """A JSON-friendly cell: timestamps as ISO text, numpy scalars as Python ones."""
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (TypeError, ValueError):
            return str(value)
    if isinstance(value, float) and value != value:  # NaN is not JSON
        return None
    return value


def _patch_pillow(Image: Any) -> None:
    from IPython.display import display

    original_save = Image.Image.save

    def show(self: Any, title: str | None = None) -> None:
        display(self)

    def save(self: Any, fp: Any, format: Any = None, **params: Any) -> Any:
        if isinstance(fp, str):
            display(self)
        return original_save(self, fp, format, **params)

    Image.Image.show = show
    Image.Image.save = save


def load_ipython_extension(ip: Any) -> None:
    formatters = ip.display_formatter.formatters
    formatters["e2b/data"] = DataFrameFormatter(parent=ip.display_formatter)
    formatters["e2b/chart"] = ChartFormatter(parent=ip.display_formatter)
    # Pillow is patched once it is imported by the user's code (importing it
    # here would slow every kernel's start).
    if "PIL.Image" in sys.modules:
        _patch_pillow(sys.modules["PIL.Image"])
    else:
        _PillowHook.install()


class _PillowHook:
    """Patches Pillow right after the user's code first imports PIL.Image."""

    @staticmethod
    def install() -> None:
        import importlib.abc
        import importlib.machinery

        class Finder(importlib.abc.MetaPathFinder):
            def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
                if name != "PIL.Image":
                    return None
                sys.meta_path.remove(self)
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                if spec is None or spec.loader is None:
                    return spec
                loader = spec.loader
                exec_module = loader.exec_module

                def run(module: Any) -> None:
                    exec_module(module)
                    _patch_pillow(module)

                loader.exec_module = run  # type: ignore[method-assign]
                return spec

        sys.meta_path.insert(0, Finder())
