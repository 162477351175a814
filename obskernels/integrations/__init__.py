"""obskernels.integrations."""
