"""Training: distributed init, config, the step loop, checkpoints."""
