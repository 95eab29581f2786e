"""A clipbench clip rule as the policy loss of TRL's GRPOTrainer, in a plain TRL script.

    python examples/trl_clipbench_rule.py                       # nsr on the tiny built-in model, CPU
    python examples/trl_clipbench_rule.py --method dapo --max-steps 20
    python examples/trl_clipbench_rule.py --model Qwen/Qwen3-0.6B --method abc   # any causal LM (GPU)

Everything is TRL's (dataset, reward function, GRPOConfig, generation, logging to `report_to`); the
clipbench part is the trainer class and its `method`, `params` and `agg` arguments. clipbench's
quadrant counts, ratio statistics and entropy are in the trainer's logs (and in every `report_to`).
"""

from __future__ import annotations

import argparse

from datasets import Dataset
from trl import GRPOConfig

from clipbench.integrations.trl import ClipbenchGRPOTrainer
from clipbench.models import load_model_and_tokenizer, resolve_model_name
from clipbench.tasks.arith import ArithTask, parse_leading_int


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:arith-tiny")
    ap.add_argument("--method", default="nsr", help="any rule of `clipbench methods` (plugins included)")
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--output-dir", default="/tmp/clipbench-trl-example")
    args = ap.parse_args()

    task = ArithTask(seed=0, train_size=256)
    problems = list(task.train_problems())
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})

    def exact_answer(prompts, completions, answer, **kwargs):  # a TRL reward function
        return [float(parse_leading_int(c) == int(a)) for c, a in zip(completions, answer)]

    model, tokenizer = load_model_and_tokenizer(resolve_model_name(args.model))
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        num_generations=4,
        steps_per_generation=2,
        max_completion_length=8,
        learning_rate=1e-4,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=args.model.startswith("builtin:"),
    )

    # The clipbench part: TRL's trainer with a clipbench rule as its policy loss.
    trainer = ClipbenchGRPOTrainer(
        model=model,
        reward_funcs=exact_answer,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        method=args.method,
        agg="token-mean",
    )
    trainer.train()

    for log in trainer.state.log_history:
        if "loss" in log:
            print(
                f"step {log['step']}: loss {log['loss']:+.4f}  clip events {log['clip_events']:.0f}  "
                f"q3 rescued {log['q3/rescued']:.0f}  ratio max {log['ratio/max']:.3f}  entropy {log['entropy']:.3f}"
            )


if __name__ == "__main__":
    main()
