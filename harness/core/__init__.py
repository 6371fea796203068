"""What the models and backends may import: the data and batch stream, the canonical weights, the cost formulas, the
learning-rate schedule, the dropout masks and the tap names."""
