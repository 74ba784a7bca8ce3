"""Training backends behind one interface (`backend.TrainBackend`): torch (default) and megatron (GPU)."""
