"""The jit kernels of the fused MSE search, one module per algorithm
(``kernels/mse_search.py`` is the launcher and describes the algorithm).

- ``_step``: the step math both paths share (one step's errors, the GPU's
  fake quantization, improvement bits, importance weights, a group tile's
  load and min/max) and ``_PER_CALL``, the scalars no kernel specialises on.
- ``_register``: ``_search_kernel``, whole groups in registers (every step,
  improvement bits, per-program step flags).
- ``_choose``: the global stop step S (the reference's patience) and each
  group's range; ``_choose_kernel`` finishes the register path.
- ``_split``: ``_minmax_part_kernel`` and ``_search_part_kernel`` (per-split
  min/max and partial errors, finished in the same launch by tickets).

``FAST`` selects the GPU's arithmetic (quant.py's GPU section); the
interpreter runs the exact emulation.
"""
