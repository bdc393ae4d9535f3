"""The unit tests run without the engine extra and the dev tools too (CI runs them so on Python 3.12, in a venv
of the base package and the test extra): the folders and modules that need what is missing are not collected."""

from __future__ import annotations

from importlib.util import find_spec

#: what a group of tests needs, and those tests (relative to this folder)
NEEDS = [
    (("torch", "numpy", "jinja2"), [
        "engine/embedding", "engine/guided", "engine/kernels", "engine/models", "engine/runtime", "engine/frameworks",
        "engine/test_output_processor.py", "engine/test_sampler.py", "engine/test_spec_decode.py",
        "engine/test_framework_seam.py", "scripts/test_engine_roofline.py",
        "serving/test_embedded.py", "serving/test_embedded_structured.py", "serving/test_embeddings.py",
        "serving/backends/test_backends.py", "serving/test_app_tools.py", "serving/test_engine_policies.py",
        "serving/test_speculative.py", "serving/test_worker_engine_metrics.py",
    ]),
    (("gguf",), ["test_packaging.py"]),
    (("kubernetes_validate",), ["deploy"]),  # the dev extra's offline Kubernetes schemas
]

collect_ignore = [path for modules, paths in NEEDS if not all(find_spec(m) for m in modules) for path in paths]
