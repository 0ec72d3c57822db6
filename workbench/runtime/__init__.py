"""The per-rank runtime: the same training loop under Ray, torchrun, a cloud launcher or in-process."""
