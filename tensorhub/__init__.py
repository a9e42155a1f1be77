"""TensorHub: reference-oriented storage for LLM weights."""
