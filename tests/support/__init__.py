"""Fakes and helpers shared by the tests: scripted LMs, fake backends, database and Redis fixtures, clusters."""
