"""pympar: an MPI-native engine for training Transformer and Mixture-of-Experts models
with data, pipeline, tensor and expert parallelism. See DESIGN in the repository."""
__version__ = "0.1.0"
