"""The torch-free text path: tokenizer, chat templates, detokenizer, stop strings, and each
choice's text as the front ends (gateway, offline LLM) build it."""
