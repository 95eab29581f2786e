"""Write the benchmark slices the tests read (tests/data/*.jsonl) from the public files they are cut from.

    python tests/data/make_slices.py SOURCE_DIR     # SOURCE_DIR: the whole public files (README.md names them)

Each slice keeps whole rows, unchanged and in their order: the first rows of each benchmark (FIRST), the
DAPO sample whole, and of ROLL's combined file the rows of the same problems (MATH-500 by the problem's
text; AIME, whose texts are worded differently there, by answer). It checks each source's sha256 and
writes SHA256SUMS (the slices') beside them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = {  # file: sha256 of the whole public file
    "aime24.jsonl": "af2b8bd2aa911b6333ad0df32f3ca05c7ae8ed10f1731f4372c8ae26990bf7ac",
    "aime25.jsonl": "b4e273c02d3e7fe1b74b59eae768fc8230bfb0f79539890cb56f4361caac0331",
    "amc23.jsonl": "43707e1ca784602d8479de24ee8ce36609dbebc46dd152b0b12a46611aa898a4",
    "math500.jsonl": "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
    "gsm8k_test.jsonl": "9f098df7ff4522078d6ccec27a5c38a454790fdb51131bedfaa0e490070d5394",
    "roll_math_benchmarks.jsonl": "24321f4b298b375791ef8f21b6290f7529001a3d98a27cdaac24b9df0dea78d8",
    "dapo_math_17k_sample.jsonl": "b3b667a0d99b0e3c7d81646b7db6cd3ac60acc2f54314b4f4d987af94670c610",
}
FIRST = {"aime24.jsonl": 8, "aime25.jsonl": 8, "amc23.jsonl": 8, "math500.jsonl": 40, "gsm8k_test.jsonl": 20}


def lines(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _number(answer) -> str:
    text = str(answer).strip().replace("^\\circ", "").replace("^{\\circ}", "")
    try:
        return str(int(float(text)))
    except ValueError:
        return text


def roll_rows(source: Path, kept: dict[str, list[str]]) -> list[str]:
    """ROLL's rows of the problems kept: MATH-500 by text, AIME by answer (each answer consumed once)."""
    math_texts = {json.loads(line)["problem"].strip() for line in kept["math500.jsonl"]}
    wanted = {
        tag: [_number(json.loads(line)["answer"]) for line in kept[name]]
        for tag, name in (("aime2024", "aime24.jsonl"), ("aime2025", "aime25.jsonl"))
    }
    out = []
    for line in lines(source):
        row = json.loads(line)
        if row["source"] == "MATH-500":
            keep = row["prompt"].strip() in math_texts
        else:
            answer = _number(row["ground_truth"])
            keep = answer in wanted[row["source"]]
            if keep:
                wanted[row["source"]].remove(answer)
        if keep:
            out.append(line)
    return out


def main(source_dir: str) -> int:
    src = Path(source_dir)
    for name, digest in SOURCES.items():
        have = hashlib.sha256((src / name).read_bytes()).hexdigest()
        if have != digest:
            sys.exit(f"{src / name}: sha256 {have}, expected {digest} (not the public file the slices come from)")
    kept = {name: lines(src / name)[:n] for name, n in FIRST.items()}
    kept["dapo_math_17k_sample.jsonl"] = lines(src / "dapo_math_17k_sample.jsonl")
    kept["roll_math_benchmarks.jsonl"] = roll_rows(src / "roll_math_benchmarks.jsonl", kept)
    sums = []
    for name in SOURCES:
        text = "".join(line + "\n" for line in kept[name])
        (HERE / name).write_text(text, encoding="utf-8")
        sums.append(f"{hashlib.sha256(text.encode()).hexdigest()}  {name}")
        print(f"{name}: {len(kept[name])} rows, {len(text.encode())} bytes")
    (HERE / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
