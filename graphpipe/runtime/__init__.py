"""Execute plans on torch.distributed (DESIGN §8). The only package that touches torch.distributed."""
