"""Developer tools that are not part of the runtime: ``kernel_report``, the
sm_90a compile and SASS report of every kernel variant (needs triton and its
bundled ptxas, never a GPU). Nothing in obskernels' runtime imports this package."""
