"""`pdserve eval compare`: one set of prompts, greedy, against a baseline and a candidate
server; scores per category, the difference in percentage points and a verdict. Torch-free."""
