"""The Hydra app the sweep's launcher plugins start: each job trains one run of a frozen manifest.

    python -m clipbench.sweep.hydra_job --multirun manifest=/abs/results/s/manifest.json \\
        run_id='1bd04df439fd','e6071dc50487' hydra/launcher=submitit_slurm hydra.launcher.partition=gpu

Started by `clipbench sweep FILE --launcher ...` (clipbench.sweep.hydra_app builds the command). Each
job is one run (`clipbench.sweep.execute.run_one`: run lock, skip / resume / start, status in the
store) and prints its outcome.
"""

from __future__ import annotations

from dataclasses import dataclass

from clipbench.sweep.execute import run_one, task_from_manifest


@dataclass
class RunJob:
    manifest: str = "???"
    run_id: str = "???"
    retry_failed: bool = False
    tracking_uri: str | None = None
    parent_run_id: str | None = None
    threads: int | None = None


def _register() -> None:
    from hydra.core.config_store import ConfigStore  # noqa: PLC0415 - hydra is heavy

    ConfigStore.instance().store(name="clipbench_run", node=RunJob)


def _job(cfg) -> dict:
    task = task_from_manifest(
        cfg.manifest,
        str(cfg.run_id),
        retry_failed=bool(cfg.retry_failed),
        tracking_uri=cfg.tracking_uri,
        parent_run_id=cfg.parent_run_id,
        threads=cfg.threads,
    )
    res = run_one(task)
    print(f"{res['outcome']:>9} {task.run_id} {task.label}", flush=True)
    return res


def main() -> None:  # pragma: no cover - exercised through `clipbench sweep --launcher`
    import hydra  # noqa: PLC0415 - hydra is heavy

    _register()
    hydra.main(version_base=None, config_path=None, config_name="clipbench_run")(_job)()


if __name__ == "__main__":  # pragma: no cover
    main()
