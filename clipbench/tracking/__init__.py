"""Results store (source of truth) and the MLflow mirror."""
