"""text: the text path of every front end (the gateway, the offline `LLM`). Torch-free.

- `tokenizer.py`: the tokenizer and chat templates;
- `detokenizer.py`: the incremental detokenizer and stop strings;
- `choice.py`: one choice's text and finish (`ChoiceText`), and the seeds of `n`
  choices (`choice_seeds`).
"""
