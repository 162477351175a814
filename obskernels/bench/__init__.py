"""obskernels.bench."""
