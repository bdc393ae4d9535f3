"""The HTTP layer (FastAPI): routes parse and authorise, ``app.serving`` does the work. See ``api.main``."""
