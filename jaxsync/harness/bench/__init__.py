"""`jaxsync bench`: every registered path side by side with its PyTorch baselines."""
