"""obskernels.examples."""
