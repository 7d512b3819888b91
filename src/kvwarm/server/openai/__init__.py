"""The OpenAI API family: chat completions, completions and infill, embeddings."""
