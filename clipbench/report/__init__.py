"""Comparison reports from the results store: Table 3 layout, significance, clip quadrants, plots.

    from clipbench.report.build import build_report, write_report
    sweep = load_results(results_dir, name); result = analyze(sweep, baseline); tables = build_tables(result, paper)

Modules: ``load`` (runs, labels), ``stats`` (pass@k per problem, CIs, the paired t over seeds, Holm,
non-inferiority and TOST, rliable's aggregates, the paired bootstrap over problems),
``analysis`` (numbers), ``tables`` (display strings), ``render`` (rich/markdown/latex/csv/html),
``plots`` (matplotlib figures), ``paper`` (the ABC-GRPO paper's reference numbers), ``claims`` (the
papers' claims as one Holm-corrected family: verdict, smallest detectable effect), ``replication``
(split-half consistency over the seeds, or replication on a second sweep), ``machines`` (where the runs ran, base-model checksums),
``claims_table`` (their display tables), ``stability`` and ``stability_table`` (gain over the base
model, collapse kinds and critical learning rate over a learning-rate axis), ``finding`` (the
report's first line).
"""
