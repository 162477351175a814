"""``python -m obskernels.tools.kernel_report``: see the package docstring."""

from obskernels.tools.kernel_report.cli import main

raise SystemExit(main())
