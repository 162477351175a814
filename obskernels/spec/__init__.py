"""The bottom layer both backends stand on: errors, checks, checked calls, search rules.

``obskernels.kernels`` (Triton) and ``obskernels.reference`` (PyTorch) import
this package (and torch / triton / numpy / compressed-tensors), never each
other and never the front (``obskernels.ops``, ``obskernels.backends``, the
observers). What both must agree on lives here once:

- ``errors``: the exceptions a backend raises (``KernelUnsupportedError``,
  ``HeldStatisticsError``).
- ``checks``: one function and one message per input rule (values, base
  names, strategies, g_idx, importance, statistics, buffers) and the dtype
  policy.
- ``record``: the layout of an observer's device record (non-finite counts,
  the importance's verdict), which the kernels write and get_qparams reads.
- ``calls``: each operation's call checked once (``calls.min_max(...)`` and
  so on) into the frozen object both backends take; the front builds them.
- ``layout``: ``Flattening``, a value checked for flattening, and
  ``GroupLayout``, the index map derived from it (``group_layout``) by which
  the kernels address raw storage.
- ``search``: the search's parameter bounds, step rule (``num_steps``),
  quantization arguments (``search_args``), ``SearchParams`` and the
  observers' defaults.
"""

from obskernels.spec import calls, checks, errors, layout, record, search
from obskernels.spec.checks import *  # noqa: F401,F403
from obskernels.spec.checks import __all__ as _checks_all
from obskernels.spec.errors import HeldStatisticsError, KernelUnsupportedError
from obskernels.spec.layout import Flattening, GroupLayout, flattening, group_layout
from obskernels.spec.record import *  # noqa: F401,F403
from obskernels.spec.record import __all__ as _record_all
from obskernels.spec.search import *  # noqa: F401,F403
from obskernels.spec.search import __all__ as _search_all

__all__ = ["calls", "checks", "errors", "layout", "record", "search", "KernelUnsupportedError",
           "HeldStatisticsError", "Flattening", "flattening", "GroupLayout", "group_layout",
           *_checks_all, *_record_all, *_search_all]
