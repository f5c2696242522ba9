"""What is trained: the built-in models, Hugging Face configs, data, and model files."""
