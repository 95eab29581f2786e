"""Where a comparison's runs ran and what they started from, from each run's provenance.json
(clipbench.tracking.provenance: one record per start or resume).

    summary = provenance_summary(runs)       # JSON-able: rows, machines, checksums, mixed, unrecorded
    provenance_lines(summary)                # the report's header lines

A machine is everything that moves a run's numbers besides its config: CPU (model, flags, torch's
SIMD level), GPU, the versions of torch / transformers / vllm / trl, Python, the OS, torch's threads
and the world size (`describe_machine`). The same numbers are expected only within one machine;
across machines, the same verdicts where they replicate. Runs of one base model whose weights'
sha256 differ did not start from the same model: every comparison between them is flagged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from clipbench.report.load import RunRecord
from clipbench.report.replication import seeds_name
from clipbench.tracking.provenance import describe_machine, weights_checksum

UNKNOWN = "unknown"


def provenance_summary(runs: Sequence[RunRecord], group: Callable[[RunRecord], str] | None = None) -> dict:
    """One row per (base model, weights sha256, machine) with its runs and their seeds by label
    (`group(run)`, default the run's label). A run resumed elsewhere counts on each machine."""
    group = group or (lambda r: r.label)
    rows: dict[tuple, dict] = {}
    for r in runs:
        starts = r.provenance or [{}]
        for key in dict.fromkeys(
            (weights_checksum(s) or UNKNOWN, describe_machine(s) if s else UNKNOWN) for s in starts
        ):
            row = rows.setdefault(
                (r.model, *key),
                {"model": r.model, "weights_sha256": key[0], "machine": key[1], "runs": [], "labels": {}},
            )
            row["runs"].append(r.run_id)
            row["labels"].setdefault(group(r), []).append(r.seed)
    out_rows = sorted(rows.values(), key=lambda x: (x["model"], x["weights_sha256"], x["machine"]))
    for row in out_rows:
        row["labels"] = {lb: sorted(set(s)) for lb, s in row["labels"].items()}
    checksums: dict[str, list[str]] = {}
    for row in out_rows:
        if row["weights_sha256"] != UNKNOWN and row["weights_sha256"] not in checksums.setdefault(row["model"], []):
            checksums[row["model"]].append(row["weights_sha256"])
    return {
        "rows": out_rows,
        "machines": sorted({row["machine"] for row in out_rows} - {UNKNOWN}),
        "checksums": checksums,
        "mixed": [m for m, shas in checksums.items() if len(shas) > 1],
        "unrecorded": sorted(r.run_id for r in runs if not r.provenance),
    }


def _who(labels: dict[str, list[int]]) -> str:
    return "; ".join(f"{lb} {seeds_name(s)}" for lb, s in labels.items())


def _merged(rows: Sequence[dict]) -> dict[str, list[int]]:
    out: dict[str, set[int]] = {}
    for row in rows:
        for lb, seeds in row["labels"].items():
            out.setdefault(lb, set()).update(seeds)
    return {lb: sorted(s) for lb, s in out.items()}


def provenance_lines(summary: dict | None) -> list[str]:
    """The header's lines: the machines the comparison spans, each base model's checksum(s), and a
    warning where runs of one base model started from different weights."""
    if not summary or not summary["rows"]:
        return []
    rows, lines = summary["rows"], []
    machines = summary["machines"]
    if machines:
        listed = "; ".join(
            f"[{i}] {m} ({_who(_merged([r for r in rows if r['machine'] == m]))})" for i, m in enumerate(machines, 1)
        )
        many = (
            f"Ran on {len(machines)} machines (the same numbers are expected only on the same machine, thread "
            f"count and world size; across them, the same verdicts where they replicate): "
        )
        lines.append((many if len(machines) > 1 else "Ran on 1 machine: ") + listed + ".")
    for model, shas in summary["checksums"].items():
        if len(shas) == 1:
            lines.append(f"Base model {model}: weights sha256 {shas[0][:12]} for every run that recorded it.")
        else:
            which = "; ".join(
                f"{sha[:12]}: {_who(_merged([r for r in rows if r['model'] == model and r['weights_sha256'] == sha]))}"
                for sha in shas
            )
            lines.append(
                f"WARNING: the runs of {model} started from {len(shas)} different base models (weights "
                f"sha256 {which}); a comparison across them mixes the base model's effect with the "
                f"methods' (flagged in the claims)."
            )
    if summary["unrecorded"]:
        lines.append(
            f"No provenance recorded for {len(summary['unrecorded'])} run(s) (written before clipbench "
            f"recorded it): their machine and base-model checksum are unknown."
        )
    return lines
