"""The OpenAI-compatible HTTP gateway: tokenizes, renders chat templates, validates, forwards
requests to the coordinator and streams detokenized text back."""
