"""Where a model's weights and files come from: checkpoint directories, random weights,
tokenizer files. Produces a ModelSource for the front end (ir/frontend.py)."""
