"""Known figures: the "mse" observer on a small int8 weight.

The weight is fp32 ``arange(24).reshape(6, 4) / 24``; the figure is the mean
squared error of the weight fake-quantized (compressed-tensors'
``fake_quantize``) with the observer's scale and zero point. The numbers are
computed independently of this code, not produced by it; absolute tolerance 1e-10.
"""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle import fake_quantize

from obskernels import Observer

FIGURES = [
    # strategy, extra args, symmetric, MSE
    ("tensor", {}, True, 4.8103e-06),
    ("tensor", {}, False, 1.1258e-06),
    ("channel", {}, True, 2.5675e-06),
    ("channel", {}, False, 2.3696e-07),
    ("group", {"group_size": 2}, True, 3.1282e-06),
    ("group", {"group_size": 2}, False, 1.3794e-07),
    ("block", {"block_structure": [3, 2]}, True, 2.8968e-06),
    ("block", {"block_structure": [3, 2]}, False, 5.6068e-07),
]
ABS_TOL = 1e-10


@pytest.mark.parametrize("strategy,extra,symmetric,figure", FIGURES, ids=lambda v: str(v))
def test_mse_observer_figure(backend, strategy, extra, symmetric, figure):
    weight = torch.arange(24, dtype=torch.float32).reshape(6, 4) / 24
    args = QuantizationArgs(num_bits=8, symmetric=symmetric, strategy=strategy, **extra)
    observer = Observer.load_from_registry("mse", base_name="weight", args=args)
    qparams = observer(weight).get_qparams()
    assert qparams["global_scale"] is None
    fq = fake_quantize(weight, qparams["scale"], qparams["zero_point"], args)
    mse = torch.mean((fq - weight) ** 2).item()
    assert abs(mse - figure) <= ABS_TOL, f"{strategy} sym={symmetric}: MSE {mse:.6e}, expected {figure:.4e}"
