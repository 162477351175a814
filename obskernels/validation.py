"""The input checks of ``obskernels.spec.checks``, under their former name."""

from obskernels.spec.checks import *  # noqa: F401,F403
from obskernels.spec.checks import __all__  # noqa: F401
