"""The model engine: configs, weights, loaders, tokenizer, decoder, generation."""
