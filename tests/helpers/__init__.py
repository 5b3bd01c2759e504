"""What test modules share, imported by name (no test module imports another test module or a conftest): builders,
oracles and scenarios (policy, lora, gpu, distributed, stack), the storage test bodies that run on both SQLite and
PostgreSQL (storage_cases), and the throwaway servers of the integration tests (services). Their asserts are rewritten
by pytest like a test module's (tests/conftest.py registers this package)."""
