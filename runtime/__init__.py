"""kiln runtime: sampling, scheduling, the engine."""
