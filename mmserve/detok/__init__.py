"""The detokenizer process: token ids to text, with stop strings."""
