"""The engine: the Action IR, schedule generators, and the orchestrator that runs them on one rank."""
