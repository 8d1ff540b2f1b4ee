"""What stops a runaway agent: the circuit breaker and near-duplicate detection."""
