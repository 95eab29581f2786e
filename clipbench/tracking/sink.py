"""Where a run's metrics go besides the results store (which the trainer always writes).

The trainer calls a `MetricSink`; the MLflow sink (`clipbench.tracking.mlflow_sink`) batches and
never raises into training. `NullSink` is the default when tracking is off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class MetricSink(Protocol):
    def log_params(self, params: dict) -> None: ...

    def log_metrics(self, step: int, metrics: dict) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def flush(self) -> None: ...

    def close(self, status: str = "FINISHED") -> None: ...


class NullSink:
    def log_params(self, params: dict) -> None:
        pass

    def log_metrics(self, step: int, metrics: dict) -> None:
        pass

    def log_artifact(self, path, artifact_path=None) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass
