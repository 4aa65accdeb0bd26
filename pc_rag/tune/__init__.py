"""Training the splice adapter by self-distillation: pairs from the tuning split, teacher data, the training loop."""
