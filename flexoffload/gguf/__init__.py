"""GGUF files: the tensor table, the catalog of real models, synthetic models."""
