"""The Celery transport of node tasks, shared by the API (which dispatches jobs) and the workers (which run
nodes and send their dependents): queue names and routing, message priorities, the Celery configuration, and
the dispatcher that sends ``inf.run_node`` messages. The one place in ``app`` that names Celery and kombu; the
tasks themselves live in ``workers/``."""
