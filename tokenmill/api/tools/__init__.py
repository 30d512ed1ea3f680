"""Tool calling: the request side (request.py: what the chat template is given, a forced call's grammar) and the
output side (parsers.py: each model family's call format read from the text, whole or streamed)."""
