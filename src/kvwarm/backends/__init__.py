"""Model runtimes: the llama.cpp backend and a deterministic stub (see ``base``)."""
