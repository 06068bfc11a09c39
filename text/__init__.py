"""The torch-free text path: tokenizer, chat templates, detokenizer, stop strings."""
