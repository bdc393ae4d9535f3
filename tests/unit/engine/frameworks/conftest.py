"""Fixtures: tiny random-weight Llama and GPT-2 checkpoints (HF folders) and engines over them, for every framework
(:mod:`tests.support.engine_fixtures`)."""

from tests.support.engine_fixtures import _one_thread, loaded, make_engine, tiny

__all__ = ["_one_thread", "loaded", "make_engine", "tiny"]
