"""Worker of tests/test_bench.py's counter test under every triton, run as a
script WITH TRITON_INTERPRET=1 by the interpreter of each triton environment
(``helpers.compile_pythons()``): the harness's Triton counter hooks the
interpreter's builder, whose signatures differ between triton releases.

It counts a masked copy and one ``ops.min_max`` call on the triton backend
and prints one JSON object: the versions, the counts, the copy's and the
statistics' correctness against torch (or the error of a triton backend that
cannot run there), and whether the counter put the interpreter back. The
test holds the expectations.
"""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import numpy  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

from obskernels import BackendUnavailableError, ops, use_backend  # noqa: E402
from obskernels.bench.traffic import count_traffic  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with PYTHONSAFEPATH=1
from counter_kernels import _masked_copy  # noqa: E402


def main() -> None:
    from triton.runtime import interpreter as ti

    before = dict(ti.InterpreterBuilder.__dict__)
    src, dst = torch.arange(100, dtype=torch.float32), torch.zeros(100)
    with count_traffic("cpu", triton=True) as copy:
        _masked_copy[(triton.cdiv(100, 32),)](src, dst, 100, 1, BLOCK=32)
    value = torch.randn(48, 272, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    row = {"triton": triton.__version__, "numpy": numpy.__version__,
           "copy": [copy.bytes_read, copy.bytes_written, copy.triton_launches, copy.triton_programs],
           "copied": torch.equal(dst, src)}
    try:
        with use_backend("triton"), count_traffic("cpu", triton=True) as stats:
            mins, maxs = ops.min_max(value, "weight", QuantizationArgs(num_bits=8, strategy="channel"))
    except BackendUnavailableError as exc:  # an interpreter that cannot run the kernels
        row["unavailable"] = str(exc)
    else:
        row["min_max"] = [stats.bytes_read, stats.bytes_written, stats.triton_launches, stats.aten_ops]
        row["statistics"] = (torch.equal(mins, value.amin(dim=1, keepdim=True))
                             and torch.equal(maxs, value.amax(dim=1, keepdim=True)))
    after = dict(ti.InterpreterBuilder.__dict__)
    row["restored"] = all(after.get(k) is v for k, v in before.items()) and set(after) == set(before)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
