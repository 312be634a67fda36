"""Training: the loop over shuffled_batches plans, optimizers, checkpoints, and the MLflow model."""
