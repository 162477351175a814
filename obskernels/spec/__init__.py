"""The bottom layer both backends stand on: errors, checks, search rules.

``obskernels.kernels`` (Triton) and ``obskernels.reference`` (PyTorch) import
this package (and torch / triton / numpy / compressed-tensors), never each
other and never the front (``obskernels.ops``, ``obskernels.backends``, the
observers). What both must agree on lives here once:

- ``errors``: the exceptions a backend raises (``KernelUnsupportedError``,
  ``HeldStatisticsError``).
- ``checks``: one function and one message per input rule (values, base
  names, strategies, g_idx, importance, statistics, buffers), the dtype
  policy and the layout of an observer's non-finite record.
- ``search``: the search's parameter bounds, step rule (``num_steps``),
  quantization arguments (``search_args``) and the observers' defaults.
- ``layout``: ``GroupLayout``, the frozen index map a flattening call is
  checked into (``group_layout``), by which the kernels address raw storage.
"""

from obskernels.spec import checks, errors, layout, search
from obskernels.spec.checks import *  # noqa: F401,F403
from obskernels.spec.checks import __all__ as _checks_all
from obskernels.spec.errors import HeldStatisticsError, KernelUnsupportedError
from obskernels.spec.layout import GroupLayout, group_layout
from obskernels.spec.search import *  # noqa: F401,F403
from obskernels.spec.search import __all__ as _search_all

__all__ = ["checks", "errors", "layout", "search", "KernelUnsupportedError", "HeldStatisticsError",
           "GroupLayout", "group_layout",
           *_checks_all, *_search_all]
