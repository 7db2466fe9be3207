"""The job runner: solves a job with ``remat`` and stores its plan, as a Celery task or in
the embedded dispatcher, plus the sweeper that requeues lost jobs; see
docs/architecture.md, "Architecture" and "Celery"."""
