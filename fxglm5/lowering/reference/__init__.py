"""Pure-torch reference semantics of every op (any device): the ground truth the kernels are tested against."""
