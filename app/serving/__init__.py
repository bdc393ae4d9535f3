"""The OpenAI-compatible serving logic: request schemas, parameter mapping, response shapes, metrics, logs.

Knows no HTTP framework: ``api/`` parses, authorises and calls :class:`OpenAIServing`, which talks to one
:class:`~app.serving.backends.Backend`.
"""

from app.serving.errors import APIError
from app.serving.metrics import ServingMetrics
from app.serving.openai_serving import OpenAIServing

__all__ = ["APIError", "OpenAIServing", "ServingMetrics"]
