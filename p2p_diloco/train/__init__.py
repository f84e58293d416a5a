"""What one island trains on and writes: the model, the data, checkpoints and metrics."""
