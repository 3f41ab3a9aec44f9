"""flashsys inside other libraries' models: `transformers` (Hugging Face) as an attention implementation."""
