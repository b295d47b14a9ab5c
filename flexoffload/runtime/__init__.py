"""The runtime on the patched llama.cpp: the engine (one model and context) and speculation."""
