"""One island: the training loop that composes the math, the training parts and the network."""
