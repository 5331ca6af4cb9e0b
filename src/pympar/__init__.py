"""pympar: an MPI-native engine for training Transformer and Mixture-of-Experts models
with data, pipeline, tensor, context and expert parallelism. The design (layers, contracts,
the determinism rule): docs/design.md; the user's guide: README.md and docs/."""
__version__ = "0.1.0"
