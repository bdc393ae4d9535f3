"""Route modules: ``openai`` (/v1/*, /tokenize, /detokenize) and ``ops`` (/health, /metrics)."""
