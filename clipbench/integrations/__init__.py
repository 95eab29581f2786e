"""clipbench inside the trainers users already run (library entry points, no engine dispatch).

    clipbench.integrations.trl      ClipbenchGRPOTrainer: TRL's GRPOTrainer with a clipbench rule as its loss
    clipbench.integrations.verl     every clipbench rule in verl's policy-loss registry (`clipbench.<name>`)
    clipbench.integrations.feeds    what a trainer's loss call feeds clipbench's loss (`Feeds`); each
                                    engine's declaration: trl_settings.FEEDS, verl_settings.FEEDS

`engine: trl` and `--engine verl` (clipbench.engines) use them to train clipbench's runs. Nothing here
imports TRL or verl until the module that needs them is imported.
"""
