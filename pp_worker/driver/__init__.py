"""The pipeline driver (``pp-pipeline``): starts N stage workers, chains them over the wire protocol, and runs
generations through them. It talks to workers only through ``pp_worker.wire``; nothing of the worker is imported."""
