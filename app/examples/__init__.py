"""Example pipelines shipped with inf-engine (usable by name from the CLI)."""

#: short names accepted by ``inf-engine run`` in place of a ``module:Class`` path
EXAMPLE_PIPELINES = {
    "review-compare": "app.examples.review_compare:ReviewCompare",
    "review-extract": "app.examples.extract:Extract",
    "sentiment": "app.examples.sentiment:SentimentLabel",
}
